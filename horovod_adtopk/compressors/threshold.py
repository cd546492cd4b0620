"""Variable-size threshold rules: DGC, Gaussian-k, RedSync, SIDCo and a fixed threshold; each estimates
a threshold ``t`` and sends ``|a| >= t`` with a count alongside."""
from __future__ import annotations

import numbers

import torch

from .. import kernels
from .. import selection as sel
from .base import (Selection, SparseCompressor, TensorInfo, _check_int, _contiguous, _flat_selection, register,
                   stable_seed)

class _ThresholdCompressor(SparseCompressor):
    """Variable-size rules: keep ``|a| >= t`` with ``t`` from :meth:`threshold`."""

    variable_count = True

    def threshold(self, a: torch.Tensor, mag: torch.Tensor, info: TensorInfo, step: int) -> float:
        raise NotImplementedError

    def _select(self, a: torch.Tensor, info: TensorInfo, step: int) -> Selection:
        mag = a.reshape(-1).abs()
        t = self.threshold(a, mag, info, step)
        values, flat = kernels.threshold_select(_contiguous(a), t)
        return _flat_selection(values, flat, info.numel, None)


@register
class DGCCompressor(_ThresholdCompressor):
    """DGC (Lin et al. 2018): threshold from a ~1% random sample of ``|a|``; when the count misses
    ``k`` by more than 25% the threshold is corrected (at most 3 extra passes), and when it selects more
    than ``1.25 k`` the exact top-k of the candidates is kept (DGC's hierarchical selection). Pass
    ``momentum=0.9`` (with a momentum-free wrapped optimizer) for DGC's momentum correction with factor
    masking."""

    name = "dgc"
    summary = ("threshold from a 1% sample of `|a|`, corrected; hierarchical top-k when over; `momentum=` for "
               "momentum correction; variable size")

    def __init__(self, ratio: float, sample_fraction: float = 0.01, seed: int = 0, **kwargs) -> None:
        super().__init__(ratio, **kwargs)
        if isinstance(sample_fraction, bool) or not isinstance(sample_fraction, numbers.Real) \
                or not (0.0 < sample_fraction <= 1.0):
            raise ValueError(f"sample_fraction must be in (0, 1], got {sample_fraction!r}")
        self.sample_fraction = float(sample_fraction)
        self.seed = _check_int("seed", seed, 0)

    def extra_config(self) -> dict:
        return {"sample_fraction": self.sample_fraction, "seed": self.seed}

    def _select(self, a: torch.Tensor, info: TensorInfo, step: int) -> Selection:
        ratio = self.ratio_at(step)
        k = sel.keep_count(ratio, info.numel)
        mag = a.reshape(-1).abs()
        gen = torch.Generator(device="cpu")
        gen.manual_seed(stable_seed("dgc", self.seed, info.name, step))
        t = sel.dgc_threshold(mag, ratio, gen, self.sample_fraction)
        t = sel.refine_threshold(mag, t, k, max_iters=3)
        values, flat = kernels.threshold_select(_contiguous(a), t)
        if flat.numel() > 1.25 * k:
            finite = torch.isfinite(values)
            keep = torch.topk(torch.where(finite, values.abs(), torch.full_like(values, float("inf"))), k,
                              sorted=False).indices
            values, flat = values[keep], flat[keep]
        return _flat_selection(values, flat, info.numel, None)


@register
class GaussiankCompressor(_ThresholdCompressor):
    """Gaussian-k (Shi et al. 2019): normal fit, then up to 5 bracketed corrections toward ``k``."""

    name = "gaussiank"
    summary = "normal fit `|mu| + sigma * Phi^-1(1 - ratio/2)`, corrected; variable size"

    def threshold(self, a, mag, info, step):
        ratio = self.ratio_at(step)
        k = sel.keep_count(ratio, info.numel)
        return sel.refine_threshold(mag, sel.gaussian_threshold(a, ratio), k, max_iters=5)


@register
class RedSyncCompressor(_ThresholdCompressor):
    """RedSync (Fang et al. 2019): binary search between mean and max of ``|a|``."""

    name = "redsync"
    summary = "binary search of `mean + r (max - mean)`; variable size"

    def threshold(self, a, mag, info, step):
        return sel.redsync_threshold(mag, sel.keep_count(self.ratio_at(step), info.numel))


@register
class SIDCoCompressor(_ThresholdCompressor):
    """SIDCo (Abdelmoniem et al. 2021): multi-stage exponential (or gamma / gpareto) tail fit, then up
    to 4 bracketed corrections toward ``k``."""

    name = "sidco"
    summary = "multi-stage exponential (or `gamma`, `gpareto`) tail fit, corrected; variable size"

    def __init__(self, ratio: float, stages: int = 2, distribution: str = "exponential", **kwargs) -> None:
        super().__init__(ratio, **kwargs)
        if distribution not in sel.SIDCO_DISTRIBUTIONS:
            raise ValueError(f"distribution must be one of {', '.join(sel.SIDCO_DISTRIBUTIONS)}, got {distribution!r}")
        self.stages, self.distribution = _check_int("stages", stages, 1), distribution

    def extra_config(self) -> dict:
        return {"stages": self.stages, "distribution": self.distribution}

    def threshold(self, a, mag, info, step):
        ratio = self.ratio_at(step)
        k = sel.keep_count(ratio, info.numel)
        t = sel.sidco_threshold(mag, ratio, self.stages, self.distribution)
        return sel.refine_threshold(mag, t, k, max_iters=4)


@register
class ThresholdCompressor(_ThresholdCompressor):
    """Fixed threshold: send every entry with ``|a| >= threshold``. ``ratio`` only sizes the hybrid
    rule's estimate of the payload (default 0.01)."""

    name = "threshold"
    summary = "`|a| >= threshold` (you give it); variable size"

    def __init__(self, threshold: float, ratio: float = 0.01, **kwargs) -> None:
        super().__init__(ratio, **kwargs)
        if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real) \
                or not (0.0 <= float(threshold) < float("inf")):
            raise ValueError(f"threshold must be a finite number >= 0, got {threshold!r}")
        self.fixed_threshold = float(threshold)

    def extra_config(self) -> dict:
        return {"threshold": self.fixed_threshold}

    def threshold(self, a, mag, info, step):
        return self.fixed_threshold
