"""Random-k: positions drawn identically on every rank, so only values travel (summed by allreduce)."""
from __future__ import annotations

from typing import Optional

import torch

from .. import selection as sel
from .base import Selection, SharedCodec, SparseCompressor, TensorInfo, _check_int, register, stable_seed

@register
class RandomkCompressor(SparseCompressor):
    """``k`` random positions, the same on every rank (private generator seeded by seed, name and step):
    no indices travel, and the values are summed by allreduce (in float32 at least, whatever
    ``value_dtype``: a reduced value dtype only rounds each rank's values, which error feedback keeps).

    Non-finite values: if ``a`` holds a NaN/Inf at a position that was not drawn, the first drawn value is
    sent as NaN, so every rank sees a non-finite gradient this step (as with dense allreduce) and the
    memory is scrubbed; nothing non-finite waits in the memory to surface later."""

    name = "randomk"
    summary = "`k` random positions, identical on every rank (seed, name, step); values only, allreduced"
    gathers = False  # values are allreduced: the allgather term of the hybrid rule does not apply

    def __init__(self, ratio: float, seed: int = 0, **kwargs) -> None:
        super().__init__(ratio, **kwargs)
        self.seed = _check_int("seed", seed, 0)

    def extra_config(self) -> dict:
        return {"seed": self.seed}

    def nominal_index_dtype(self, info: TensorInfo) -> Optional[torch.dtype]:
        return None

    def _select(self, a: torch.Tensor, info: TensorInfo, step: int) -> Selection:
        k = sel.keep_count(self.ratio_at(step), info.numel)
        gen = torch.Generator(device="cpu")
        gen.manual_seed(stable_seed(self.seed, info.name, step))
        flat = sel.random_positions(info.numel, k, gen, a.device)
        values = a.reshape(-1)[flat]
        finite = torch.isfinite(a).all()
        if not bool(finite):
            values[0] = float("nan")
        return Selection(values, flat, None, SharedCodec(flat), finite=finite)
