"""Independent numpy reference of the selection rules and of error-feedback aggregation.

Written from the specification (README / issue text), not from the package: nothing here imports
horovod_adtopk.
"""
from __future__ import annotations

import math
from typing import Dict, List

import numpy as np


AUTO_TOLERANCE = 0.05  # the documented tolerance of axis="auto" (README / selection docs)


def resolve_axis(rows: int, cols: int, axis, ratio=None) -> int:
    """axis="auto": row fibers when k = max(1, floor(ratio * cols)) keeps k / cols within 5% (relative) of
    ratio; otherwise the longer axis (rows on ties)."""
    if axis == "auto":
        if ratio is not None and cols > 0:
            k_row = max(1, int(math.floor(ratio * cols)))
            if abs(k_row - ratio * cols) <= AUTO_TOLERANCE * ratio * cols:
                return 1
        return 1 if cols >= rows else 0
    return int(axis)


def adtopk_mask(a: np.ndarray, ratio: float, axis) -> np.ndarray:
    """Every fiber of ``a.reshape(d0, -1)`` keeps its max(1, floor(ratio * len)) largest |entries|."""
    m = a.reshape(a.shape[0], -1)
    rows, cols = m.shape
    ax = resolve_axis(rows, cols, axis, ratio)
    mt = m if ax == 1 else m.T
    k = max(1, int(math.floor(ratio * mt.shape[1])))
    mag = np.abs(mt)
    mag = np.where(np.isnan(mag), np.inf, mag)
    order = np.argsort(-mag, axis=1, kind="stable")[:, :k]
    mask_t = np.zeros(mt.shape, dtype=bool)
    np.put_along_axis(mask_t, order, True, axis=1)
    mask = mask_t if ax == 1 else mask_t.T
    return mask.reshape(a.shape)


def joined_rows_mask(a: np.ndarray, ratio: float, min_fiber_len: int) -> np.ndarray:
    """ADTopk with short rows joined: where the rows of ``a.reshape(d0, -1)`` are shorter than
    ``min_fiber_len``, they are taken ``g`` at a time (``g`` the smallest divisor of d0 with ``g * cols >=
    min_fiber_len``, else all rows), each group of whole rows one fiber keeping its max(1, floor(ratio * g *
    cols)) largest |entries|; otherwise ADTopk with axis "auto"."""
    if a.size // a.shape[0] >= min_fiber_len:
        return adtopk_mask(a, ratio, "auto")
    return adtopk_mask(a.reshape(joined_rows_shape(a.shape, min_fiber_len)), ratio, 1).reshape(a.shape)


def joined_rows_shape(shape, min_fiber_len: int):
    """The matrix view of joined_rows_mask: ``[d0 / g, g * cols]`` where rows are short, else ``[d0, cols]``."""
    rows = int(shape[0])
    cols = int(np.prod(shape[1:]))
    if cols >= min_fiber_len:
        return rows, cols
    g = next((d for d in range(1, rows + 1) if rows % d == 0 and d * cols >= min_fiber_len), rows)
    return rows // g, g * cols


def joined_columns_mask(a: np.ndarray, ratio: float, min_fiber_len: int) -> np.ndarray:
    """ADTopk with short columns joined: where the columns of ``M = a.reshape(d0, -1)`` are shorter than
    ``min_fiber_len``, fiber ``j`` (of ``cols / g``) is every entry ``M[r, c]`` with ``c % (cols / g) == j``
    (``g`` whole columns; ``g`` the smallest divisor of cols with ``g * d0 >= min_fiber_len``, else all
    columns), keeping its max(1, floor(ratio * g * d0)) largest |entries|; otherwise ADTopk with axis "auto".
    Built here from the column indices, not from a reshape."""
    m = a.reshape(a.shape[0], -1)
    rows, cols = m.shape
    if rows >= min_fiber_len:
        return adtopk_mask(a, ratio, "auto")
    nfib = joined_columns_shape(a.shape, min_fiber_len)[1]
    k = max(1, int(math.floor(ratio * rows * (cols // nfib))))
    mask = np.zeros(m.shape, dtype=bool)
    for j in range(nfib):
        cs = np.arange(j, cols, nfib)
        sub = np.abs(m[:, cs])
        sub = np.where(np.isnan(sub), np.inf, sub)
        # flat order within the fiber: row-major over (row, column), the order of the [rows * g, cols / g] view
        order = np.argsort(-sub.reshape(-1), kind="stable")[:k]
        r, c = np.divmod(order, len(cs))
        mask[r, cs[c]] = True
    return mask.reshape(a.shape)


def joined_columns_shape(shape, min_fiber_len: int):
    """The matrix view of joined_columns_mask: ``[d0 * g, cols / g]`` where columns are short, else
    ``[d0, cols]``."""
    cols_view, rows_view = joined_rows_shape((int(np.prod(shape[1:])), int(shape[0])), min_fiber_len)
    return rows_view, cols_view  # joined_rows_shape with the roles of rows and columns swapped


def topk_mask(a: np.ndarray, ratio: float) -> np.ndarray:
    flat = np.abs(a.reshape(-1))
    k = max(1, int(math.floor(ratio * flat.size)))
    order = np.argsort(-flat, kind="stable")[:k]
    mask = np.zeros(flat.size, dtype=bool)
    mask[order] = True
    return mask.reshape(a.shape)


def round_bf16(x: np.ndarray) -> np.ndarray:
    """float64 -> float32 -> bfloat16 (round to nearest, ties to even), returned as float64."""
    u = np.asarray(x, dtype=np.float64).astype(np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def quantize_group(v: np.ndarray, bits: int) -> np.ndarray:
    """The low-bit value rule of the outer exchange: the group's magnitudes (float32), ranked ascending (ties
    by position), fall into 2 ** (bits - 1) bins of equal count (bin = rank * L // n); each bin's level is the
    mean magnitude of its entries rounded to bfloat16; an entry is carried as its sign times its bin's level."""
    levels_n, n = 2 ** (bits - 1), v.size
    mag = np.abs(v.astype(np.float32)).astype(np.float64)
    rank = np.empty(n, dtype=np.int64)
    rank[np.argsort(mag, kind="stable")] = np.arange(n)
    bins = rank * levels_n // n
    level = np.zeros(levels_n)
    for b in range(levels_n):
        if (bins == b).any():
            level[b] = mag[bins == b].sum() / (bins == b).sum()
    carried = round_bf16(level)[bins]
    return np.where(np.signbit(v.astype(np.float32)), -carried, carried)


def fiber_run(fibers: int, k: int, value_group=None) -> int:
    """Fibers per set of levels: the smallest divisor of ``fibers`` whose fibers keep ``value_group`` entries."""
    return next(d for d in range(1, fibers + 1) if fibers % d == 0 and (d * k >= (value_group or 1) or d == fibers))


def quantize_sparse(a: np.ndarray, mask: np.ndarray, bits: int, fiber_axis=None, value_group=None) -> np.ndarray:
    """What a quantized sparse payload carries, as a dense array: ``a`` at ``mask`` quantized per group, zeros
    elsewhere. Groups: each fiber of ``a.reshape(d0, -1)`` (``fiber_axis`` 1: rows, 0: columns), or, with
    ``fiber_axis=None``, every kept entry together (flat rules). ``value_group=n``: the group is the smallest run
    of consecutive fibers, its length dividing the number of fibers, that keeps at least ``n`` entries."""
    m, keep = a.reshape(a.shape[0], -1), mask.reshape(a.shape[0], -1)
    out = np.zeros_like(m, dtype=np.float64)
    if fiber_axis is None:
        out[keep] = quantize_group(m[keep], bits)
        return out.reshape(a.shape)
    mt, kt, ot = (m, keep, out) if fiber_axis == 1 else (m.T, keep.T, out.T)
    fibers, k = mt.shape[0], int(kt[0].sum())
    run = fiber_run(fibers, k, value_group)
    for start in range(0, fibers, run):
        rows = range(start, start + run)
        carried = quantize_group(np.concatenate([mt[i, kt[i]] for i in rows]), bits)
        for j, i in enumerate(rows):
            ot[i, kt[i]] = carried[j * k:(j + 1) * k]
    return out.reshape(a.shape)


def bitpack(x: np.ndarray, width: int) -> np.ndarray:
    """Each integer's low ``width`` bits, LSB first, packed into bytes (numpy's packbits, little bit order)."""
    bits = ((np.asarray(x, dtype=np.int64)[:, None] >> np.arange(width)) & 1).astype(np.uint8).reshape(-1)
    return np.packbits(bits, bitorder="little")


def threshold_mask(a: np.ndarray, t: float) -> np.ndarray:
    return (np.abs(a) >= t) | ~np.isfinite(a)


def index_bytes(max_index: int) -> int:
    return 2 if max_index <= 32767 else (4 if max_index <= 2**31 - 1 else 8)


def adtopk_is_sparse(shape, ratio, axis, elem_bytes: int, value_bytes: int, min_numel: int) -> bool:
    """The documented dense-path rule (with hybrid=False): 1-D, numel < min_numel, or payload >= dense."""
    if len(shape) < 2 or int(np.prod(shape)) < min_numel:
        return False
    rows, cols = shape[0], int(np.prod(shape[1:]))
    ax = resolve_axis(rows, cols, axis, ratio)
    fib_len, nfib = (cols, rows) if ax == 1 else (rows, cols)
    k = max(1, int(math.floor(ratio * fib_len)))
    payload = nfib * k * (value_bytes + index_bytes(fib_len - 1))
    return payload < rows * cols * elem_bytes


def flat_is_sparse(shape, ratio, elem_bytes: int, value_bytes: int) -> bool:
    """Dense-path rule for flat-index rules (Top-k, thresholds; hybrid=False, min_numel=0)."""
    numel = int(np.prod(shape))
    if len(shape) < 2:
        return False
    k = max(1, int(math.floor(ratio * numel)))
    return k * (value_bytes + index_bytes(numel - 1)) < numel * elem_bytes


def simulate(grads: List[List[Dict[str, np.ndarray]]], select, sparse: Dict[str, bool], error_feedback: bool = True,
             wire_dtype=None, average: bool = True, present=None) -> List[Dict[str, np.ndarray]]:
    """Expected aggregated gradient per step.

    grads[rank][step][name]: each rank's local gradient. ``select(a, name) -> bool mask``. Dense tensors
    are averaged exactly; sparse ones go through error feedback and selection on every rank, then the
    ranks' contributions are summed in rank order (in the gradient dtype) and averaged.
    ``present[rank][step][name]`` False: that rank had no gradient (unused parameter): it contributes
    nothing and keeps its memory.
    """
    world = len(grads)
    steps = len(grads[0])
    residual = [dict() for _ in range(world)]
    out = []
    for t in range(steps):
        agg = {}
        for name in grads[0][t]:
            dtype = grads[0][t][name].dtype
            total = np.zeros_like(grads[0][t][name])
            for r in range(world):
                g = grads[r][t][name]
                if present is not None and not present[r][t][name]:
                    continue
                if not sparse[name]:
                    total = total + g
                    continue
                a = g + residual[r][name] if (error_feedback and name in residual[r]) else g.copy()
                mask = select(a, name)
                carried = a.astype(wire_dtype).astype(dtype) if wire_dtype is not None else a
                sent = np.where(mask, carried, np.zeros_like(a))
                if error_feedback:
                    residual[r][name] = (a - sent).astype(dtype)
                total = (total + sent).astype(dtype)
            agg[name] = (total / world).astype(dtype) if average else total
        out.append(agg)
    return out


def check_fold_3_to_2(old_ranks: dict, store: str, name: str, new: list) -> None:
    """A gathered 3-rank memory entry ``old_ranks[i]["memory"][store][name]`` (tensors) resumed at 2 ranks
    (``new[j]``, numpy): new rank j holds (2/3) * the sum of old ranks i with i mod 2 == j, so the pending
    update sum_j r'_j / 2 equals sum_i r_i / 3."""
    old = [old_ranks[i]["memory"][store][name].double().numpy() for i in range(3)]
    np.testing.assert_allclose(new[0], (old[0] + old[2]) * 2 / 3, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(new[1], old[1] * 2 / 3, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(sum(new) / 2, sum(old) / 3, rtol=1e-5, atol=1e-8)
