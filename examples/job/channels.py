"""Per-layer update statistics (``--channel-stats FILE``): how much of each weight the applied update
touched, and whether every output channel got something.

After every optimizer step, for every trainable parameter of two or more dimensions (convolution and
linear weights; dimension 0 is the output channel), the aggregated gradient that the optimizer applied
(``p.grad`` after the exchange, the same on every rank) gives:

- ``density``: the share of its entries that are non-zero;
- ``channel_share``: the share of its output channels (slices ``p.grad[i]``) with at least one non-zero entry.

Means over all steps and over the steps after the compression warm-up (``--dense-rounds`` +
``--density-warmup``), and the smallest channel share seen after it, go to FILE as JSON (rank 0). A global
top-k can leave output channels without any update for many steps; ADTopk with row fibers cannot. Statistics
start afresh in a resumed process.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch


class ChannelStats:
    def __init__(self, model: torch.nn.Module, path: str, steady_after: int) -> None:
        self.path, self.steady_after = Path(path), steady_after
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
        # per layer: [steps, density sum, share sum, steady steps, steady density sum, steady share sum, min share]
        self.sums = {n: [0, 0.0, 0.0, 0, 0.0, 0.0, 1.0] for n, _ in self.params}

    @torch.no_grad()
    def observe(self, step: int) -> None:
        """Account the update of optimizer step ``step`` (1-based)."""
        for n, p in self.params:
            if p.grad is None:
                continue
            nz = p.grad.reshape(p.grad.shape[0], -1) != 0
            density, share = float(nz.float().mean()), float(nz.any(dim=1).float().mean())
            s = self.sums[n]
            s[0], s[1], s[2] = s[0] + 1, s[1] + density, s[2] + share
            if step > self.steady_after:
                s[3], s[4], s[5], s[6] = s[3] + 1, s[4] + density, s[5] + share, min(s[6], share)

    def summary(self, opt_stats: Optional[dict] = None) -> dict:
        tensors = (opt_stats or {}).get("tensors", {})
        layers = {}
        for n, p in self.params:
            steps, dsum, ssum, st, sd, ss, smin = self.sums[n]
            layers[n] = {"shape": list(p.shape), "path": tensors.get(n, {}).get("path"),
                         "steps": steps, "density": dsum / steps if steps else None,
                         "channel_share": ssum / steps if steps else None,
                         "steady_steps": st, "steady_density": sd / st if st else None,
                         "steady_channel_share": ss / st if st else None, "steady_min_channel_share": smin if st else None}
        return {"steady_after_step": self.steady_after, "layers": layers}

    def write(self, opt_stats: Optional[dict] = None) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.summary(opt_stats), indent=1) + "\n")
