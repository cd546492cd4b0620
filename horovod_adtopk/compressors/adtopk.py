"""ADTopk and its variants: all-dimension top-k (per-fiber top-k, see :mod:`horovod_adtopk.selection`),
ADTopk-I (interleaved with global top-k) and ADTopk-T (threshold-estimated between exact steps)."""
from __future__ import annotations

import copy
import numbers
from typing import Dict, Optional, Tuple

import torch

from .. import kernels
from .. import selection as sel
from ..wire import index_dtype_for
from .base import (FiberCodec, Selection, SparseCompressor, TensorInfo, _check_int, _contiguous, _flat_selection,
                   register)
from .topk import TopkCompressor

@register
class ADTopkCompressor(SparseCompressor):
    """All-dimension top-k (see :mod:`horovod_adtopk.selection`). ``axis``: 0, 1 or "auto"."""

    name = "adtopk"
    summary = ("per-fiber top-k of `reshape(d0, -1)`; `axis` 0, 1 or `\"auto\"` (contiguous rows when their "
               "density is within 5% of ratio, else the longer axis); `min_fiber_len` joins short rows (or "
               "columns: `join=\"columns\"`); fixed size, fiber-local int16/int32 indices")

    def __init__(self, ratio: float, axis="auto", min_fiber_len: Optional[int] = None, join: str = "rows",
                 **kwargs) -> None:
        super().__init__(ratio, **kwargs)
        sel.resolve_axis(2, 2, axis)  # validates
        self.axis = axis
        self.min_fiber_len = sel.check_min_fiber_len(min_fiber_len, axis, join)
        self.join = join
        # one codec per tensor (name, shape), replaced when the layout changes: during a density warm-up "auto"
        # can pick another axis with the same k, so the whole layout is compared, not k alone
        self._codecs: Dict[Tuple[str, Tuple[int, ...]], FiberCodec] = {}

    def extra_config(self) -> dict:
        extra = {"axis": self.axis}
        if self.min_fiber_len is not None:  # only when set, so that earlier configurations compare unchanged
            extra["min_fiber_len"] = self.min_fiber_len
        if self.join != "rows":
            extra["join"] = self.join
        return extra

    def for_block(self, axis: int) -> "ADTopkCompressor":
        """A shallow copy that selects a block of an already-planned tensor (the hierarchical exchange): the
        tensor's resolved fiber ``axis`` (``"auto"`` decided on the whole tensor must not be decided again on
        a block's shape) and no joining (the block's fibers are the tensor's, joined already where
        ``min_fiber_len`` joined them). It shares this compressor's codec cache and adaptive state (ADTopk-T),
        so checkpoints and resets of the original cover the blocks."""
        view = copy.copy(self)
        view.axis = axis
        view.min_fiber_len, view.join = None, "rows"
        return view

    def layout(self, info: TensorInfo, ratio: Optional[float] = None) -> sel.FiberLayout:
        return sel.fiber_layout(info.shape, self.ratio if ratio is None else ratio, self.axis, self.min_fiber_len,
                                self.join)

    def codec(self, info: TensorInfo, step: Optional[int] = None) -> FiberCodec:
        layout = self.layout(info, None if step is None else self.ratio_at(step))
        key = (info.name, layout.shape)
        c = self._codecs.get(key)
        if c is None or c.layout != layout:  # selections already made keep their own codec for decoding
            c = self._codecs[key] = FiberCodec(layout)
        return c

    def nominal_count(self, info: TensorInfo) -> int:
        return self.layout(info).count

    def nominal_index_dtype(self, info: TensorInfo) -> Optional[torch.dtype]:
        return index_dtype_for(self.layout(info).fiber_len - 1)

    def selection_summary(self, info: TensorInfo) -> dict:
        """The rule's summary plus the fiber layout at the target ratio: the axis the fibers run along of the
        ``[rows, cols]`` matrix view (1: rows are fibers), how many fibers, their length and ``k`` per fiber."""
        lay = self.layout(info)
        return {**super().selection_summary(info), "matrix": [lay.rows, lay.cols], "axis": lay.axis,
                "fibers": lay.num_fibers, "fiber_len": lay.fiber_len, "k": lay.k}

    def _fiber_topk(self, a, codec, grad=None, zero_sent=False) -> Selection:
        lay = codec.layout
        values, local = kernels.adtopk_select(_contiguous(a), lay.rows, lay.cols, lay.axis, lay.k,
                                              None if grad is None else _contiguous(grad), zero_sent,
                                              hint=codec.hint(a))
        return Selection(values.reshape(-1), codec.to_flat(local), local.reshape(-1), codec)

    def _select_fused(self, a, info, step, grad, zero_sent) -> Selection:
        return self._fiber_topk(a, self.codec(info, step), grad, zero_sent)

    def _select(self, a: torch.Tensor, info: TensorInfo, step: int) -> Selection:
        return self._fiber_topk(a, self.codec(info, step))


@register
class ADTopkICompressor(ADTopkCompressor):
    """ADTopk-I (interleaved): on step ``s`` a parameter uses all-dimension top-k when
    ``s % period == 0`` and exact global top-k otherwise (period 2: they alternate, ADTopk first, as in
    the authors' code). The step comes from the optimizer, which saves it in ``state_dict()``, so a
    resumed run continues the same schedule."""

    name = "adtopk_i"
    summary = ("ADTopk-I: step `s` uses ADTopk when `s % period == 0`, exact global top-k otherwise "
               "(`period=2`); fixed size per step")

    def __init__(self, ratio: float, period: int = 2, **kwargs) -> None:
        super().__init__(ratio, **kwargs)
        self.period = _check_int("period", period, 1)

    def extra_config(self) -> dict:
        return {**super().extra_config(), "period": self.period}

    def nominal_count(self, info: TensorInfo) -> int:
        return max(self.layout(info).count, sel.keep_count(self.ratio, info.numel))

    def nominal_index_dtype(self, info: TensorInfo) -> Optional[torch.dtype]:
        return index_dtype_for(info.numel - 1)

    def uses_adtopk(self, step: int) -> bool:
        return step % self.period == 0

    def _select_fused(self, a, info, step, grad, zero_sent) -> Selection:
        if self.uses_adtopk(step):
            return super()._select_fused(a, info, step, grad, zero_sent)
        return TopkCompressor._select_fused(self, a, info, step, grad, zero_sent)

    def _select(self, a: torch.Tensor, info: TensorInfo, step: int) -> Selection:
        if self.uses_adtopk(step):
            return super()._select(a, info, step)
        return TopkCompressor._select_fused(self, a, info, step, None, False)


@register
class ADTopkTCompressor(ADTopkCompressor):
    """ADTopk-T (threshold-estimated ADTopk).

    Per parameter: on an *exact* step, run all-dimension top-k and record every fiber's threshold
    ``theta_f`` = the smallest ``|a|`` it kept. On the ``tau - 1`` steps in between, send the entries with
    ``|a| >= theta_f`` of their fiber (one comparison pass, no sort; variable size, flat indices).

    Adapting ``tau`` (per parameter, on magnitudes; the authors shared one ``tau`` across all layers and
    compared signed values): at each exact step, with ``delta`` = median over fibers of
    ``|theta_new - theta_old| / theta_old``: ``delta < tolerance`` (default 0.1) -> ``tau += 1`` up to
    ``tau_max``; otherwise ``tau -= 1`` down to ``tau_min``. ``tau`` starts at ``tau_min``; the first
    ``warmup`` steps are all exact.
    """

    name = "adtopk_t"
    summary = ("ADTopk-T: exact ADTopk every `tau` steps records per-fiber thresholds; in between "
               "`|a| >= theta_fiber`; variable size")
    variable_count = True

    def __init__(self, ratio: float, tau_min: int = 1, tau_max: int = 16, tolerance: float = 0.1,
                 warmup: int = 2, **kwargs) -> None:
        super().__init__(ratio, **kwargs)
        self.tau_min, self.tau_max = _check_int("tau_min", tau_min, 1), _check_int("tau_max", tau_max, 1)
        if self.tau_min > self.tau_max:
            raise ValueError(f"need 1 <= tau_min <= tau_max, got tau_min={tau_min!r}, tau_max={tau_max!r}")
        if isinstance(tolerance, bool) or not isinstance(tolerance, numbers.Real) or not tolerance > 0:
            raise ValueError(f"tolerance must be a number > 0, got {tolerance!r}")
        self.tolerance, self.warmup = float(tolerance), _check_int("warmup", warmup, 0)
        self._state: Dict[str, dict] = {}

    def extra_config(self) -> dict:
        return {**super().extra_config(), "tau_min": self.tau_min, "tau_max": self.tau_max,
                "tolerance": self.tolerance, "warmup": self.warmup}

    def nominal_index_dtype(self, info: TensorInfo) -> Optional[torch.dtype]:
        return index_dtype_for(info.numel - 1)

    def _select_fused(self, a, info, step, grad, zero_sent) -> Selection:
        return SparseCompressor._select_fused(self, a, info, step, grad, zero_sent)

    def _select(self, a: torch.Tensor, info: TensorInfo, step: int) -> Selection:
        codec = self.codec(info, step)
        st = self._state.get(info.name)
        lay = codec.layout
        stale = st is None or st["theta"].numel() != lay.num_fibers or st.get("axis", lay.axis) != lay.axis
        exact = stale or step < self.warmup or st["since"] + 1 >= st["tau"]
        if not exact:
            st["since"] += 1
            values, flat = kernels.fiber_threshold_select(_contiguous(a), lay.rows, lay.cols, lay.axis,
                                                          st["theta"].to(a.device))
            return _flat_selection(values, flat, info.numel, None)
        s = self._fiber_topk(a, codec)
        values = s.values.view(lay.num_fibers, -1)
        theta = values.abs().amin(dim=1).detach().to(torch.float64)
        theta = torch.nan_to_num(theta, nan=0.0, posinf=0.0)
        if stale:
            st = self._state[info.name] = {"tau": self.tau_min, "since": 0, "theta": theta, "axis": lay.axis}
        else:
            old = st["theta"].to(theta.device)
            delta = float(((theta - old).abs() / old.clamp_min(1e-30)).median())
            st["tau"] = min(st["tau"] + 1, self.tau_max) if delta < self.tolerance else max(st["tau"] - 1, self.tau_min)
            st["theta"], st["since"], st["axis"] = theta, 0, lay.axis
        return _flat_selection(s.values, s.flat, info.numel, None)

    def state_dict(self) -> dict:
        return {name: {"tau": s["tau"], "since": s["since"], "theta": s["theta"].cpu().clone(),
                       **({"axis": s["axis"]} if "axis" in s else {})}
                for name, s in self._state.items()}

    def load_state_dict(self, state: dict) -> None:
        self._state = {name: {"tau": int(s["tau"]), "since": int(s["since"]), "theta": s["theta"].clone(),
                              **({"axis": int(s["axis"])} if "axis" in s else {})}
                       for name, s in state.items()}

    def reset_state(self) -> None:
        self._state.clear()
