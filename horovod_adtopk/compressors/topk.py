"""Global Top-k: the exact top-k of the flattened tensor (the baseline ADTopk is measured against)."""
from __future__ import annotations

import torch

from .. import kernels
from .. import selection as sel
from .base import Selection, SparseCompressor, TensorInfo, _contiguous, _flat_selection, register

@register
class TopkCompressor(SparseCompressor):
    """Exact global top-k of the flattened tensor, ``k = max(1, floor(ratio * numel))``."""

    name = "topk"
    summary = "exact global top-k, `k = max(1, floor(ratio * numel))`; fixed size, flat indices"

    def _select_fused(self, a, info, step, grad, zero_sent) -> Selection:
        k = sel.keep_count(self.ratio_at(step), info.numel)
        values, flat = kernels.topk_select(_contiguous(a), k, None if grad is None else _contiguous(grad), zero_sent)
        return _flat_selection(values, flat, info.numel, k)

    def _select(self, a: torch.Tensor, info: TensorInfo, step: int) -> Selection:
        return self._select_fused(a, info, step, None, False)
