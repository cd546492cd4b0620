"""Triton kernels for the selection rules on CUDA tensors (ADTopk, global top-k, thresholds).

The public functions take contiguous tensors of dtype float16 / bfloat16 / float32 / float64. On a CUDA
device they run compiled Triton kernels; CPU tensors work only under the Triton interpreter
(``TRITON_INTERPRET=1`` set before this module is imported), which is how CI tests them. Importing this
module never fails: :func:`available` says whether Triton is importable, and every function raises a
``RuntimeError`` when it is not (callers fall back to ``torch.topk``).

Ordering keys
-------------
Selection ranks ``|a|``. The bit pattern of a non-negative IEEE float, read as an integer, orders like
the float itself, so every kernel works on the integer key ``bits(a) & 0x7f..f`` (the sign bit cleared),
clamped to the bits of +Inf. NaN therefore ties with +-Inf, and both rank above every finite magnitude,
as in ``tests/reference.py``. Keys are int32 for 16- and 32-bit floats, int64 for float64.

Exact k-th largest key (radix select)
-------------------------------------
The k-th largest key ``T`` of a fiber is found digit by digit from the most significant bit, ``RB`` bits
per round: with the digits above fixed (``prefix``), one pass counts, for every candidate
``c_d = prefix + d << shift`` (``d = 0 .. 2**RB - 1``), how many keys are ``>= c_d``; the largest ``c_d``
whose count is still ``>= k`` becomes the new prefix. After ``KEY_BITS / RB`` rounds the prefix is ``T``,
and ``above`` (kept along the way: the count of keys ``>=`` the first candidate that failed) is the number
of keys strictly greater than ``T``. The write pass then keeps every key ``> T`` and the first
``k - above`` keys ``== T`` in index order (ties go to lower indices, deterministically), compacting the
kept entries with a prefix sum, so positions come out ascending.

Kernels
-------
- ``_fiber_topk_kernel``: one program per block of ``FB`` fibers. A fiber that fits in ``BLOCK`` is read
  from memory once (the whole fiber stays in registers for all rounds and the write); longer fibers are
  streamed in ``BLOCK`` chunks once per round (a fiber of a running program stays in L2 between rounds).
  Row fibers (axis 1) use tiles ``[FB, BLOCK]`` contiguous along the fiber; column fibers (axis 0) use
  ``FB`` neighbouring columns per program, contiguous along the fiber-block dimension, so each load of a
  tile reads contiguous row segments (coalesced), no transposed copy. Exception: long columns that would
  give fewer than ``COLUMN_MIN_PROGRAMS`` programs (e.g. a BERT embedding [30522, 768], 768 columns) are
  selected on a transposed contiguous copy, one program per fiber, for parallelism (the grad add and the
  zeroing then run as torch ops on ``a``). The error-feedback add ``a += grad`` is fused into the first
  read (streamed fibers: a separate first pass that writes ``a`` back).
- ``_bucket_topk_kernel``: the same body (``_select_fibers``) for the fibers of several tensors in one launch
  (:func:`bucket_adtopk_select`): each program reads its row of a fiber table (the tensor's offsets in the
  residual, gradient and output buffers, its first fiber, fiber count, length, ``cols`` and ``k``); one launch
  per launch configuration (``FB``, ``BLOCK``, one pass or streamed, axis), so a bucket takes a few. With a
  wire, the same stores also write each tensor's wire block (values cast to the wire dtype, narrow fiber-local
  indices) into one ``uint8`` buffer and a non-finite flag per tensor (``_store_wire``).
- ``_bucket_decode_kernel`` (:func:`bucket_decode`): one rank's packed blocks of a bucket added into the dense
  outputs, one launch per rank after ``_zero_regions_kernel`` cleared the tensors' regions.
- Flat (global) selection, all programs together: per round, ``_radix_count_kernel`` counts the
  candidates of every block and adds them to a global histogram with integer atomics (exact and
  order-independent, hence deterministic), then a one-program ``_radix_step_kernel`` folds the histogram
  into the device-side state (prefix, count above), so the rounds need no host synchronisation. Then
  ``_flat_count_kernel`` counts the kept entries per block, ``torch.cumsum`` turns those counts into output
  offsets, and ``_flat_write_kernel`` writes values and flat indices in ascending order. The same
  count / scan / write
  pair serves the threshold rules and :func:`count_at_least`.
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Optional, Tuple

import torch

try:  # Triton is optional: the package falls back to torch.topk without it.
    import triton
    import triton.language as tl
    _IMPORT_ERROR: Optional[BaseException] = None
except Exception as exc:  # pragma: no cover - exercised only where Triton is absent
    triton = None
    tl = None
    _IMPORT_ERROR = exc

__all__ = ["available", "interpreted", "adtopk_select", "bucket_adtopk_select", "bucket_table", "bucket_decode",
           "decode_tables", "fused_config", "topk_select", "threshold_select",
           "fiber_threshold_select", "count_at_least"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: (key width in bits of the float, significant key bits, +Inf bit pattern) per dtype.
_KEYINFO = {
    torch.float16: (16, 15, 0x7C00),
    torch.bfloat16: (16, 15, 0x7F80),
    torch.float32: (32, 31, 0x7F800000),
    torch.float64: (64, 63, 0x7FF0000000000000),
}


def available() -> bool:
    """True when Triton can be imported (CUDA tensors then run compiled kernels)."""
    return triton is not None


def interpreted() -> bool:
    """True when this module's kernels were built for the Triton interpreter (``TRITON_INTERPRET=1`` at
    import time): they then run on CPU tensors."""
    return triton is not None and _INTERPRETED


_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
#: The interpreter runs a launch on global state: launches from two threads (the DDP hook selecting the next
#: bucket while a future's callback decodes the last) are serialised under it. Compiled launches need no lock.
_INTERPRETER_LOCK = threading.RLock() if _INTERPRETED else contextlib.nullcontext()


def _check(a: torch.Tensor, name: str = "a") -> None:
    if triton is None:
        raise RuntimeError(f"horovod_adtopk.triton_kernels needs Triton, which could not be imported "
                           f"({_IMPORT_ERROR!r}); use torch.topk instead")
    if not isinstance(a, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(a).__name__}")
    if a.dtype not in _DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {a.dtype}")
    if not a.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if a.device.type == "cpu" and not _INTERPRETED:
        raise RuntimeError("CPU tensors need the Triton interpreter: set TRITON_INTERPRET=1 before importing "
                           "horovod_adtopk.triton_kernels (or pass CUDA tensors)")
    if a.device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"unsupported device {a.device}")


def _check_grad(a: torch.Tensor, grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if grad is None:
        return None
    if grad.numel() != a.numel() or grad.device != a.device:
        raise ValueError(f"grad must have a's numel ({a.numel()}) and device ({a.device}), "
                         f"got {grad.numel()} on {grad.device}")
    if grad.dtype != a.dtype:
        grad = grad.to(a.dtype)
    return grad.contiguous()


# ----------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _keys(x, KW: tl.constexpr, INF: tl.constexpr):
        """Integer ordering key of |x| (NaN clamped to +Inf's key)."""
        return tl.minimum(_rawkey(x, KW), INF)

    @triton.jit
    def _round_bf16(s):
        """float32 ``s`` rounded to bfloat16 (to nearest, ties to even; NaN stays NaN) on the bits: what the GPU's
        conversion does and what the Triton interpreter's conversion (truncating) does not."""
        bits = s.to(tl.int32, bitcast=True)
        mag = bits & 0x7FFFFFFF
        r = ((mag + 0x7FFF + ((mag >> 16) & 1)) >> 16) | ((bits >> 16) & 0x8000)
        r = tl.where(mag > 0x7F800000, 0x7FC0, r)  # NaN: torch's one bfloat16 NaN, whatever the sign
        return r.to(tl.int16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _add(x, g):
        """``x + g`` rounded once to ``x``'s dtype. 16-bit floats add in float32, which is exact before that
        one rounding (24 >= 2 * 11 + 2 bits, so no double-rounding error), as torch does it (bfloat16 through
        :func:`_round_bf16`)."""
        if x.dtype == tl.bfloat16:
            return _round_bf16(x.to(tl.float32) + g.to(tl.float32))
        elif x.dtype == tl.float16:
            return (x.to(tl.float32) + g.to(tl.float32)).to(tl.float16)
        else:
            return x + g

    @triton.jit
    def _wire_cast(x, WT: tl.constexpr):
        """``x`` as the wire dtype ``WT``, as torch's ``.to`` rounds it (to nearest even; float64 and float16 go
        to bfloat16 through float32, as torch converts them)."""
        if WT == tl.bfloat16:
            if x.dtype == tl.bfloat16:
                return x
            return _round_bf16(x.to(tl.float32))
        else:
            return x.to(WT)

    @triton.jit
    def _remainder(x, WT: tl.constexpr, KW: tl.constexpr, INF: tl.constexpr):
        """What the wire does not carry of ``x``: ``x - x.to(WT).to(x.dtype)`` with NaN and +-Inf as 0 (the
        memory's ``update`` after a rounding wire)."""
        back = _wire_cast(x, WT).to(x.dtype)
        if x.dtype == tl.bfloat16:  # rounded once, as _add (the interpreter cannot negate a bfloat16 tensor)
            r = _round_bf16(x.to(tl.float32) - back.to(tl.float32))
        elif x.dtype == tl.float16:
            r = (x.to(tl.float32) - back.to(tl.float32)).to(tl.float16)
        else:
            r = x - back
        return tl.where(_rawkey(r, KW) < INF, r, 0.0).to(x.dtype)

    @triton.jit
    def _rawkey(x, KW: tl.constexpr):
        """Bits of |x| as a non-negative integer (NaN above +Inf), no float arithmetic."""
        if KW == 16:
            b = x.to(tl.int16, bitcast=True).to(tl.int32) & 0x7FFF
        elif KW == 32:
            b = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        else:
            b = x.to(tl.int64, bitcast=True) & 0x7FFFFFFFFFFFFFFF
        return b

    @triton.jit
    def _tile(fib, fmask, jj, L, cols, AXIS: tl.constexpr):
        """Offsets and mask of the ``[FB, BLOCK]`` tile of positions ``jj`` of fibers ``fib``: along a row
        (``AXIS == 1``, contiguous) or down a column (strided by ``cols``)."""
        if AXIS == 1:
            off = fib[:, None] * cols + jj[None, :]
        else:
            off = fib[:, None] + jj[None, :].to(tl.int64) * cols
        return off, fmask[:, None] & (jj < L)[None, :]

    @triton.jit
    def _candidates(prefix, shift, R: tl.constexpr):
        """``[FB, R]`` candidates ``prefix + d << shift`` and whether each is valid (did not overflow)."""
        d = tl.arange(0, R).to(prefix.dtype)
        cand = prefix[:, None] + (d[None, :] << shift)
        valid = cand >= prefix[:, None]
        return cand, valid

    @triton.jit
    def _choose(cnt, cand, valid, prefix, above, k):
        """One radix round: the largest candidate with count >= k becomes the prefix."""
        cnt = tl.where(valid, cnt, 0)
        ok = cnt >= k
        new_prefix = tl.max(tl.where(ok, cand, 0), axis=1).to(prefix.dtype)
        new_prefix = tl.maximum(new_prefix, prefix)
        new_above = tl.maximum(above, tl.max(tl.where(ok, -1, cnt), axis=1).to(above.dtype))
        # Exactly k keys reach the new prefix: they are the top k, and later rounds cannot change the set.
        hit = (tl.min(tl.where(ok, cnt, 2147483647), axis=1) == k).to(tl.int32)
        return new_prefix, new_above, hit

    @triton.jit
    def _fiber_topk_kernel(a_ptr, g_ptr, val_ptr, idx_ptr, n_fibers, L, cols, k,
                           AXIS: tl.constexpr, HAS_GRAD: tl.constexpr, ZERO: tl.constexpr,
                           FB: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr,
                           RB: tl.constexpr, KEY_BITS: tl.constexpr, KW: tl.constexpr, INF: tl.constexpr,
                           EARLY: tl.constexpr):
        pid = tl.program_id(0)
        fib = (pid * FB + tl.arange(0, FB)).to(tl.int64)
        _select_fibers(a_ptr, g_ptr, val_ptr, idx_ptr, val_ptr, idx_ptr, idx_ptr, fib, fib < n_fibers, L, cols, k,
                       AXIS, HAS_GRAD, ZERO, False, False, tl.float32, FB, BLOCK, ONE_PASS, RB, KEY_BITS, KW, INF,
                       EARLY)

    @triton.jit
    def _bucket_topk_kernel(a_ptr, g_ptr, val_ptr, idx_ptr, wv_ptr, wi_ptr, flag_ptr, tab_ptr,
                            AXIS: tl.constexpr, HAS_GRAD: tl.constexpr, ZERO: tl.constexpr,
                            WIRE: tl.constexpr, REM: tl.constexpr, WT: tl.constexpr,
                            FB: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr,
                            RB: tl.constexpr, KEY_BITS: tl.constexpr, KW: tl.constexpr, INF: tl.constexpr,
                            EARLY: tl.constexpr):
        """Fibers of several tensors in one launch: program ``pid`` reads its row of the fiber table
        (``TABLE_COLUMNS`` int64: offsets of the tensor in ``a`` / ``grad`` / the outputs, its first fiber,
        fiber count, fiber length, ``cols``, ``k``, and for the wire its value and index offsets in the wire
        buffer (in elements of each view) and its flag) and selects like ``_fiber_topk_kernel`` on that tensor."""
        row = tab_ptr + tl.program_id(0).to(tl.int64) * 11
        a_off = tl.load(row)
        g_off = tl.load(row + 1)
        out_off = tl.load(row + 2)
        first = tl.load(row + 3)
        n_fibers = tl.load(row + 4)
        L = tl.load(row + 5).to(tl.int32)
        cols = tl.load(row + 6).to(tl.int32)
        k = tl.load(row + 7).to(tl.int32)
        fib = first + tl.arange(0, FB).to(tl.int64)
        if WIRE:
            wv = wv_ptr + tl.load(row + 8)
            wi = wi_ptr + tl.load(row + 9)
            fl = flag_ptr + tl.load(row + 10)
        else:
            wv, wi, fl = wv_ptr, wi_ptr, flag_ptr
        _select_fibers(a_ptr + a_off, g_ptr + g_off, val_ptr + out_off, idx_ptr + out_off, wv, wi, fl, fib,
                       fib < n_fibers, L, cols, k, AXIS, HAS_GRAD, ZERO, WIRE, REM, WT, FB, BLOCK, ONE_PASS, RB,
                       KEY_BITS, KW, INF, EARLY)

    @triton.jit
    def _select_fibers(a_ptr, g_ptr, val_ptr, idx_ptr, wv_ptr, wi_ptr, flag_ptr, fib, fmask, L, cols, k,
                       AXIS: tl.constexpr, HAS_GRAD: tl.constexpr, ZERO: tl.constexpr,
                       WIRE: tl.constexpr, REM: tl.constexpr, WT: tl.constexpr, FB: tl.constexpr,
                       BLOCK: tl.constexpr, ONE_PASS: tl.constexpr,
                       RB: tl.constexpr, KEY_BITS: tl.constexpr, KW: tl.constexpr, INF: tl.constexpr,
                       EARLY: tl.constexpr):
        """Top-k of the fibers ``fib`` (masked by ``fmask``) of one tensor: the body of both fiber kernels.

        Writes each fiber's values (``val``) and positions (``idx``: fiber-local, or with ``WIRE`` the flat
        positions in the tensor) at ``fib * k``. With ``WIRE`` also the wire's values (cast to ``WT``, at
        ``wv``) and fiber-local indices (``wi``'s integer type), and a 1 into ``flag`` when a sent value is
        NaN or +-Inf. ``ZERO`` zeroes the sent entries of ``a``; with ``REM`` they keep what the wire's
        rounding did not carry (:func:`_remainder`). ``WIRE`` with ``ZERO`` also zeroes the NaN / +-Inf left
        unsent (more than ``k`` in a fiber): the memory's scrub at the end of the round, which would zero them
        anyway (non-finite keys rank above every finite one, so a fiber that leaves one unsent sent only
        non-finite values, and its tensor is flagged), done where no host has to read the flag first."""
        # done[f]: exactly k keys of fiber f reach its prefix, so "key >= prefix" selects its top k. With
        # EARLY, the rounds stop once every fiber of the program is done (fibers past the end count as done).
        done = tl.where(fmask, 0, 1).to(tl.int32)
        j = tl.arange(0, BLOCK)
        R: tl.constexpr = 1 << RB
        ROUNDS: tl.constexpr = KEY_BITS // RB
        if KW == 64:
            prefix = tl.zeros([FB], dtype=tl.int64)
        else:
            prefix = tl.zeros([FB], dtype=tl.int32)
        above = tl.zeros([FB], dtype=tl.int32)

        if ONE_PASS:
            # The whole fiber fits in one tile: read it once, keep it in registers.
            off, m = _tile(fib, fmask, j, L, cols, AXIS)
            x = tl.load(a_ptr + off, mask=m, other=0.0)
            if HAS_GRAD:
                x = _add(x, tl.load(g_ptr + off, mask=m, other=0.0))
            key = tl.where(m, _keys(x, KW, INF), -1)
            for r in range(ROUNDS):
                if tl.min(done, axis=0) == 0:
                    shift = KEY_BITS - RB * (r + 1)
                    cand, valid = _candidates(prefix, shift, R)
                    cnt = tl.sum((key[:, :, None] >= cand[:, None, :]).to(tl.int32), axis=1)
                    prefix, above, hit = _choose(cnt, cand, valid, prefix, above, k)
                    if EARLY:
                        done = tl.maximum(done, hit)
            need = k - above
            eq = key == prefix[:, None]
            eq_rank = tl.cumsum(eq.to(tl.int32), axis=1)
            sel = (key > prefix[:, None]) | (eq & (eq_rank <= need[:, None]))
            sel = tl.where(done[:, None] > 0, key >= prefix[:, None], sel)
            pos = tl.cumsum(sel.to(tl.int32), axis=1) - 1
            out = fib[:, None] * k + pos
            tl.store(val_ptr + out, x, mask=sel)
            jl = j[None, :] + tl.zeros([FB, BLOCK], dtype=tl.int32)
            if WIRE:
                _store_wire(wv_ptr, wi_ptr, flag_ptr, idx_ptr, out, off, jl, x, key, sel, WT, INF)
            else:
                tl.store(idx_ptr + out, jl.to(tl.int64), mask=sel)
            if WIRE and ZERO:  # the unsent NaN / Inf go too: the memory's scrub, done here (see _select_fibers)
                kept = tl.where(key < INF, x, 0.0).to(x.dtype)
            else:
                kept = x
            if REM:
                tl.store(a_ptr + off, tl.where(sel, _remainder(x, WT, KW, INF), kept), mask=m)
            elif ZERO:
                tl.store(a_ptr + off, tl.where(sel, 0.0, kept).to(x.dtype), mask=m)
            elif HAS_GRAD:
                tl.store(a_ptr + off, x, mask=m)
        else:
            if HAS_GRAD:
                for c in range(0, L, BLOCK):
                    jj = c + j
                    off, m = _tile(fib, fmask, jj, L, cols, AXIS)
                    x = _add(tl.load(a_ptr + off, mask=m, other=0.0), tl.load(g_ptr + off, mask=m, other=0.0))
                    tl.store(a_ptr + off, x, mask=m)
                tl.debug_barrier()
            for r in range(ROUNDS):
                if tl.min(done, axis=0) == 0:
                    shift = KEY_BITS - RB * (r + 1)
                    cand, valid = _candidates(prefix, shift, R)
                    cnt = tl.zeros([FB, R], dtype=tl.int32)
                    for c in range(0, L, BLOCK):
                        jj = c + j
                        off, m = _tile(fib, fmask, jj, L, cols, AXIS)
                        x = tl.load(a_ptr + off, mask=m, other=0.0)
                        key = tl.where(m, _keys(x, KW, INF), -1)
                        cnt += tl.sum((key[:, :, None] >= cand[:, None, :]).to(tl.int32), axis=1)
                    prefix, above, hit = _choose(cnt, cand, valid, prefix, above, k)
                    if EARLY:
                        done = tl.maximum(done, hit)
            need = k - above
            eq_seen = tl.zeros([FB], dtype=tl.int32)
            out_seen = tl.zeros([FB], dtype=tl.int32)
            for c in range(0, L, BLOCK):
                jj = c + j
                off, m = _tile(fib, fmask, jj, L, cols, AXIS)
                x = tl.load(a_ptr + off, mask=m, other=0.0)
                key = tl.where(m, _keys(x, KW, INF), -1)
                eq = key == prefix[:, None]
                eq_rank = eq_seen[:, None] + tl.cumsum(eq.to(tl.int32), axis=1)
                sel = (key > prefix[:, None]) | (eq & (eq_rank <= need[:, None]))
                sel = tl.where(done[:, None] > 0, key >= prefix[:, None], sel)
                sel_i = sel.to(tl.int32)
                pos = out_seen[:, None] + tl.cumsum(sel_i, axis=1) - 1
                out = fib[:, None] * k + pos
                tl.store(val_ptr + out, x, mask=sel)
                jl = jj[None, :] + tl.zeros([FB, BLOCK], dtype=tl.int32)
                if WIRE:
                    _store_wire(wv_ptr, wi_ptr, flag_ptr, idx_ptr, out, off, jl, x, key, sel, WT, INF)
                else:
                    tl.store(idx_ptr + out, jl.to(tl.int64), mask=sel)
                if REM:
                    tl.store(a_ptr + off, _remainder(x, WT, KW, INF), mask=sel)
                elif ZERO:
                    tl.store(a_ptr + off, tl.zeros([FB, BLOCK], dtype=x.dtype), mask=sel)
                if WIRE and ZERO:  # the unsent NaN / Inf (the memory's scrub)
                    tl.store(a_ptr + off, tl.zeros([FB, BLOCK], dtype=x.dtype), mask=m & (key >= INF) & (sel == 0))
                eq_seen += tl.sum(eq.to(tl.int32), axis=1)
                out_seen += tl.sum(sel_i, axis=1)

    @triton.jit
    def _store_wire(wv_ptr, wi_ptr, flag_ptr, idx_ptr, out, off, jl, x, key, sel, WT: tl.constexpr,
                    INF: tl.constexpr):
        """The wire's share of a tile's stores: flat positions, wire values and indices, the non-finite flag."""
        tl.store(idx_ptr + out, off, mask=sel)
        tl.store(wv_ptr + out, _wire_cast(x, WT), mask=sel)
        tl.store(wi_ptr + out, jl.to(wi_ptr.dtype.element_ty), mask=sel)
        bad = tl.max(tl.max((sel & (key >= INF)).to(tl.int32), axis=1), axis=0)
        tl.atomic_max(flag_ptr, bad)

    @triton.jit
    def _bucket_decode_kernel(wv_ptr, wi_ptr, out_ptr, scale_ptr, tab_ptr, HAS_SCALE: tl.constexpr,
                              BLOCK: tl.constexpr):
        """One rank's packed blocks added into the dense outputs: program ``pid`` reads its row of the decode
        table (the tensor's value and index offsets in the rank's row of the wire, its entry count, the first
        entry of the program, its offset in ``out``, ``k``, the fiber axis and ``cols``) and adds
        ``value.to(out) * scale`` at each entry's flat position (unique within a rank's block, so no atomics)."""
        row = tab_ptr + tl.program_id(0).to(tl.int64) * 8
        v_off = tl.load(row)
        i_off = tl.load(row + 1)
        count = tl.load(row + 2)
        e = tl.load(row + 3) + tl.arange(0, BLOCK).to(tl.int64)
        out_off = tl.load(row + 4)
        k = tl.load(row + 5)
        axis = tl.load(row + 6)
        cols = tl.load(row + 7)
        m = e < count
        v = tl.load(wv_ptr + v_off + e, mask=m, other=0.0)
        loc = tl.load(wi_ptr + i_off + e, mask=m, other=0).to(tl.int64)
        fib = e // k
        flat = tl.where(axis == 1, fib * cols + loc, loc * cols + fib)
        OT: tl.constexpr = out_ptr.dtype.element_ty
        x = _wire_cast(v, OT)
        if HAS_SCALE:  # torch's ``x * scale``: in float32 for 16-bit floats (float64 for float64), rounded once
            sc = tl.load(scale_ptr)
            if OT == tl.bfloat16:
                x = _round_bf16(x.to(tl.float32) * sc)
            else:
                x = (x.to(sc.dtype) * sc).to(OT)
        cur = tl.load(out_ptr + out_off + flat, mask=m, other=0.0)
        tl.store(out_ptr + out_off + flat, _add(cur, x), mask=m)

    @triton.jit
    def _zero_regions_kernel(out_ptr, tab_ptr, BLOCK: tl.constexpr):
        """Zero ``out[offset + start : offset + min(start + BLOCK, numel)]`` for this program's row
        (``offset, numel, start``)."""
        row = tab_ptr + tl.program_id(0).to(tl.int64) * 3
        j = tl.load(row + 2) + tl.arange(0, BLOCK).to(tl.int64)
        tl.store(out_ptr + tl.load(row) + j, tl.zeros([BLOCK], dtype=out_ptr.dtype.element_ty),
                 mask=j < tl.load(row + 1))

    @triton.jit
    def _radix_count_kernel(a_ptr, g_ptr, hist_ptr, state_ptr, n, rnd,
                            HAS_GRAD: tl.constexpr, BLOCK: tl.constexpr, RB: tl.constexpr,
                            KEY_BITS: tl.constexpr, KW: tl.constexpr, INF: tl.constexpr):
        """One round of the flat radix select: add this block's candidate counts to ``hist[rnd]``."""
        R: tl.constexpr = 1 << RB
        pid = tl.program_id(0)
        off = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = off < n
        x = tl.load(a_ptr + off, mask=m, other=0.0)
        if HAS_GRAD:
            x = _add(x, tl.load(g_ptr + off, mask=m, other=0.0))
            tl.store(a_ptr + off, x, mask=m)
        key = tl.where(m, _keys(x, KW, INF), -1)
        prefix = tl.load(state_ptr + tl.arange(0, 1))
        if KW != 64:
            prefix = prefix.to(tl.int32)
        cand, valid = _candidates(prefix, KEY_BITS - RB * (rnd + 1), R)
        cnt = tl.sum((key[:, None] >= cand).to(tl.int64), axis=0)  # [R]
        d = tl.arange(0, R)
        vrow = tl.sum(valid.to(tl.int32), axis=0) > 0
        tl.atomic_add(hist_ptr + rnd * R + d, cnt, mask=vrow & (cnt > 0))

    @triton.jit
    def _radix_step_kernel(hist_ptr, state_ptr, k, rnd, RB: tl.constexpr, KEY_BITS: tl.constexpr,
                           KW: tl.constexpr):
        """One program: fold round ``rnd``'s histogram into the state (prefix, #keys above the range)."""
        R: tl.constexpr = 1 << RB
        prefix = tl.load(state_ptr + tl.arange(0, 1))
        if KW != 64:
            prefix = prefix.to(tl.int32)
        above = tl.load(state_ptr + 1 + tl.arange(0, 1))
        cand, valid = _candidates(prefix, KEY_BITS - RB * (rnd + 1), R)
        cnt = tl.load(hist_ptr + rnd * R + tl.arange(0, R))[None, :]
        prefix, above, _hit = _choose(cnt, cand, valid, prefix, above, k)
        tl.store(state_ptr + tl.arange(0, 1), prefix.to(tl.int64))
        tl.store(state_ptr + 1 + tl.arange(0, 1), above)

    @triton.jit
    def _flat_pred(x, off, pid, t_ptr, state_ptr, k, cols,
                   MODE: tl.constexpr, AXIS: tl.constexpr, RB: tl.constexpr, KEY_BITS: tl.constexpr,
                   KW: tl.constexpr, INF: tl.constexpr):
        """(sure, tie) masks of one block: ``sure`` entries are kept; ``tie`` ones compete by index order.

        MODE 0: top-k (keys > T sure, == T ties); 1: |x| >= t or non-finite; 2: per-fiber thresholds;
        3: |x| >= t (count_at_least: NaN not counted)."""
        key = _keys(x, KW, INF)
        if MODE == 0:
            thr = tl.load(state_ptr)  # T, from the radix rounds
            sure = key > thr
            tie = key == thr
        else:
            # Integer keys only (|x| >= t <=> rawkey(x) >= rawkey(t) for t >= 0; the wrapper clamps t >= 0).
            if MODE == 2:
                if AXIS == 1:
                    fib = off // cols
                else:
                    fib = off % cols
                tkey = _rawkey(tl.load(t_ptr + fib), KW)
            else:
                tkey = _rawkey(tl.load(t_ptr), KW)
            raw = _rawkey(x, KW)
            if MODE == 3:
                sure = (raw >= tkey) & (raw <= INF)  # NaN never counts
            else:
                sure = (raw >= tkey) | (raw >= INF)  # non-finite always kept
            tie = key < 0  # none: keys are >= 0
        return sure, tie

    @triton.jit
    def _flat_count_kernel(a_ptr, t_ptr, state_ptr, cnt_ptr, n, k, cols,
                           MODE: tl.constexpr, AXIS: tl.constexpr, BLOCK: tl.constexpr, RB: tl.constexpr,
                           KEY_BITS: tl.constexpr, KW: tl.constexpr, INF: tl.constexpr):
        pid = tl.program_id(0)
        off = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = off < n
        x = tl.load(a_ptr + off, mask=m, other=0.0)
        sure, tie = _flat_pred(x, off, pid, t_ptr, state_ptr, k, cols, MODE, AXIS, RB, KEY_BITS, KW, INF)
        tl.store(cnt_ptr + 2 * pid, tl.sum((sure & m).to(tl.int64), axis=0))
        tl.store(cnt_ptr + 2 * pid + 1, tl.sum((tie & m).to(tl.int64), axis=0))

    @triton.jit
    def _flat_write_kernel(a_ptr, t_ptr, state_ptr, start_ptr, val_ptr, idx_ptr, n, k, cols,
                           MODE: tl.constexpr, AXIS: tl.constexpr, ZERO: tl.constexpr, BLOCK: tl.constexpr,
                           RB: tl.constexpr, KEY_BITS: tl.constexpr, KW: tl.constexpr, INF: tl.constexpr):
        pid = tl.program_id(0)
        off = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = off < n
        x = tl.load(a_ptr + off, mask=m, other=0.0)
        sure, tie = _flat_pred(x, off, pid, t_ptr, state_ptr, k, cols, MODE, AXIS, RB, KEY_BITS, KW, INF)
        sure = sure & m
        tie = tie & m
        sure_before = tl.load(start_ptr + 2 * pid)  # exclusive prefix sums over blocks
        tie_before = tl.load(start_ptr + 2 * pid + 1)
        if MODE == 0:
            need = k - tl.load(state_ptr + 1)  # ties to take: k - #(keys > T)
        else:
            need = 0
        tie_rank = tie_before + tl.cumsum(tie.to(tl.int64), axis=0)  # 1-based among all ties
        sel = sure | (tie & (tie_rank <= need))
        taken_before = sure_before + tl.minimum(tie_before, need)  # ties taken by earlier blocks
        pos = taken_before + tl.cumsum(sel.to(tl.int64), axis=0) - 1
        tl.store(val_ptr + pos, x, mask=sel)
        tl.store(idx_ptr + pos, off, mask=sel)
        if ZERO:
            tl.store(a_ptr + off, tl.zeros([BLOCK], dtype=x.dtype), mask=sel)


# ----------------------------------------------------------------------------------------------------
# Launch helpers
# ----------------------------------------------------------------------------------------------------
def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _key_params(dtype: torch.dtype, rb: int):
    kw, bits, inf = _KEYINFO[dtype]
    key_bits = -(-bits // rb) * rb
    return kw, key_bits, inf


#: Longest fiber kept in registers (one memory pass); longer fibers are streamed.
ONE_PASS_MAX = 4096
#: Stop a fiber program's radix rounds once exactly k keys reach every fiber's prefix (the low bits of the
#: k-th key need not be found then). False runs every round (kept to measure the difference).
EARLY_EXIT = True
#: Radix bits per round for resident fibers (compute bound: 1 bit, 2 candidates) and streamed ones
#: (memory/L2 bound: 4 bits, 16 candidates, a quarter of the passes).
RB_RESIDENT = 1
RB_STREAM = 4
#: Long column fibers (streamed, axis 0) in fewer program blocks than this are selected on a transposed
#: contiguous copy instead (one program per fiber: more parallelism when there are few columns).
COLUMN_MIN_PROGRAMS = 264
#: Elements per program of the flat kernels.
FLAT_BLOCK = 1024


def _fiber_config(L: int, n_fibers: int, axis: int):
    """(FB, BLOCK, ONE_PASS, RB, num_warps) for a fiber top-k launch."""
    if axis == 1:
        if L <= ONE_PASS_MAX:
            block = max(16, _pow2(L))
            fb = max(1, min(_pow2(n_fibers), 2048 // block))  # pack short fibers, ~2K elements a tile
            return fb, block, True, RB_RESIDENT, 4 if fb * block <= 2048 else 8
        return 1, 512, False, RB_STREAM, 4
    # Column fibers: FB neighbouring columns per program, contiguous along FB.
    fb = max(16, min(64, _pow2(n_fibers)))
    if L * fb <= ONE_PASS_MAX:
        return fb, max(16, _pow2(L)), True, RB_RESIDENT, 4
    fb = min(fb, 32)
    return fb, 16, False, RB_STREAM, 4


def adtopk_select(a: torch.Tensor, rows: int, cols: int, axis: int, k: int, grad: Optional[torch.Tensor] = None,
                  zero_sent: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-fiber exact top-``k`` of ``|a|`` with ``a`` viewed ``[rows, cols]`` (fibers: rows for ``axis=1``,
    columns for ``axis=0``).

    ``grad``: first ``a += grad`` in place (error feedback, fused into the first read). ``zero_sent``: set the
    selected entries of ``a`` to 0 afterwards. Returns ``(values [num_fibers, k]`` in ``a``'s dtype,
    ``local [num_fibers, k]`` int64 positions inside each fiber, ascending). NaN and +-Inf rank above every
    finite magnitude; ties go to the lower position.
    """
    _check(a)
    grad = _check_grad(a, grad)
    rows, cols, axis, k = int(rows), int(cols), int(axis), int(k)
    if axis not in (0, 1):
        raise ValueError(f"axis must be 0 or 1, got {axis}")
    if rows * cols != a.numel():
        raise ValueError(f"rows * cols = {rows * cols} != a.numel() = {a.numel()}")
    n_fibers, L = (rows, cols) if axis == 1 else (cols, rows)
    if not 1 <= k <= L:
        raise ValueError(f"k must be in [1, fiber_len={L}], got {k}")
    values = torch.empty((n_fibers, k), dtype=a.dtype, device=a.device)
    local = torch.empty((n_fibers, k), dtype=torch.int64, device=a.device)
    if n_fibers == 0:
        return values, local
    fb, block, one_pass, rb, warps = _fiber_config(L, n_fibers, axis)
    if axis == 0 and not one_pass and triton.cdiv(n_fibers, fb) < COLUMN_MIN_PROGRAMS:
        # Few long columns: a transposed copy gives one program per fiber (grad add and zeroing on a).
        if grad is not None:
            a.add_(grad.view_as(a))
        t = a.view(rows, cols).t().contiguous()
        values, local = adtopk_select(t, cols, rows, 1, k)
        if zero_sent:
            a.view(rows, cols).t().scatter_(1, local, 0)
        return values, local
    kw, key_bits, inf = _key_params(a.dtype, rb)
    grid = (triton.cdiv(n_fibers, fb),)
    with _INTERPRETER_LOCK:
        _fiber_topk_kernel[grid](a, grad if grad is not None else a, values, local, n_fibers, L, cols, k,
                                 AXIS=axis, HAS_GRAD=grad is not None, ZERO=bool(zero_sent), FB=fb, BLOCK=block,
                                 ONE_PASS=one_pass, RB=rb, KEY_BITS=key_bits, KW=kw, INF=inf, EARLY=EARLY_EXIT,
                                 num_warps=warps)
    return values, local


#: int64 columns of one row of a bucket's fiber table (one row per program of :func:`bucket_adtopk_select`).
TABLE_COLUMNS = 11

#: torch dtype -> Triton dtype of the wire values.
_TL_DTYPES = {} if triton is None else {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
                                        torch.float32: tl.float32, torch.float64: tl.float64}


def fused_config(rows: int, cols: int, axis: int):
    """The launch configuration of one tensor's fibers, or None where :func:`adtopk_select` would take its
    transposed-copy route (few long columns), which a bucket launch does not fuse."""
    n_fibers, L = (rows, cols) if axis == 1 else (cols, rows)
    fb, block, one_pass, rb, warps = _fiber_config(L, n_fibers, axis)
    if axis == 0 and not one_pass and -(-n_fibers // fb) < COLUMN_MIN_PROGRAMS:
        return None
    return axis, fb, block, one_pass, rb, warps


def bucket_table(entries):
    """Host-side fiber table of several tensors: ``entries`` are ``(config, a_off, g_off, out_off, rows, cols,
    axis, k)`` with ``config`` from :func:`fused_config`, optionally followed by the wire's ``(index_dtype,
    value_off, index_off, flag)`` (the tensor's index dtype, its offsets in the wire buffer viewed as the value
    dtype and as the index dtype, its flag's position). Returns ``(rows, groups)``: the table's rows (lists of
    ``TABLE_COLUMNS`` ints, one per program, grouped by launch) and ``groups``, ``(config, first_row, n_rows)``
    per launch, ``config`` extended by the index dtype where given. Shapes only: nothing is read from a device."""
    by_config = {}
    for config, a_off, g_off, out_off, rows, cols, axis, k, *wire in entries:
        n_fibers, L = (rows, cols) if axis == 1 else (cols, rows)
        fb = config[1]
        idt, wv_off, wi_off, flag = wire if wire else (None, 0, 0, 0)
        progs = by_config.setdefault(config + ((idt,) if wire else ()), [])
        for first in range(0, n_fibers, fb):
            progs.append([a_off, g_off, out_off, first, n_fibers, L, cols, k, wv_off, wi_off, flag])
    table, groups = [], []
    for config, progs in by_config.items():
        groups.append((config, len(table), len(progs)))
        table.extend(progs)
    return table, groups


def bucket_adtopk_select(a: torch.Tensor, grad: Optional[torch.Tensor], values: torch.Tensor, local: torch.Tensor,
                         table: torch.Tensor, groups, zero_sent: bool = False, wire: Optional[torch.Tensor] = None,
                         wire_dtype: Optional[torch.dtype] = None, flags: Optional[torch.Tensor] = None,
                         remainder: bool = False) -> None:
    """Per-fiber top-k of several tensors held in the 1-D buffer ``a`` (each at its offset), one launch per
    configuration group of the fiber table (:func:`bucket_table`, uploaded to ``a``'s device as int64
    ``[n, TABLE_COLUMNS]``). ``grad`` (1-D, ``a``'s dtype; offsets from the table) is added into ``a`` first;
    ``zero_sent`` zeroes what was selected. Writes each tensor's ``values`` and fiber-local positions
    (``local``, int64) at its output offset, ``[num_fibers, k]`` fiber-major: what :func:`adtopk_select` returns
    for that tensor, bit for bit. No host synchronisation.

    With a ``wire`` (a ``uint8`` buffer; the groups' configs end with their index dtype): ``local`` receives
    the flat positions in each tensor instead, and each tensor's wire values (``wire_dtype``) and fiber-local
    indices are written into ``wire`` at the table's offsets; ``flags`` (int32, zeros) get a 1 for a tensor that
    sends a NaN or +-Inf. ``remainder`` (with ``zero_sent``): the sent entries keep what the wire's rounding
    does not carry instead of 0."""
    _check(a)
    if grad is not None:
        _check(grad, "grad")
        if grad.dtype != a.dtype or grad.device != a.device:
            raise ValueError("grad must have a's dtype and device")
    if values.dtype != a.dtype or local.dtype != torch.int64:
        raise ValueError("values must have a's dtype and local must be int64")
    if wire is not None and (wire.dtype != torch.uint8 or wire_dtype not in _TL_DTYPES or flags is None
                             or flags.dtype != torch.int32):
        raise ValueError("a wire needs a uint8 buffer, a float wire_dtype and int32 flags")
    for config, first, n in groups:
        axis, fb, block, one_pass, rb, warps = config[:6]
        kw, key_bits, inf = _key_params(a.dtype, rb)
        tab = table[first:first + n]
        if wire is not None:
            wv, wi, fl, wt = wire.view(wire_dtype), wire.view(config[6]), flags, _TL_DTYPES[wire_dtype]
        else:
            wv, wi, fl, wt = values, local, local, tl.float32
        with _INTERPRETER_LOCK:
            _bucket_topk_kernel[(n,)](a, grad if grad is not None else a, values, local, wv, wi, fl, tab,
                                      AXIS=axis, HAS_GRAD=grad is not None, ZERO=bool(zero_sent),
                                      WIRE=wire is not None, REM=bool(zero_sent and remainder), WT=wt, FB=fb,
                                      BLOCK=block, ONE_PASS=one_pass, RB=rb, KEY_BITS=key_bits, KW=kw, INF=inf,
                                      EARLY=EARLY_EXIT, num_warps=warps)


#: Entries per program of the bucket decode, elements per program of its zeroing.
DECODE_BLOCK = 1024


def decode_tables(entries, out_numels):
    """Host-side tables of :func:`bucket_decode`: ``entries`` are ``(index_dtype, value_off, index_off, count,
    out_off, k, axis, cols)`` per tensor (wire offsets in elements of the value and index views of a rank's row);
    ``out_numels`` the tensors' sizes in ``out``. Returns ``(rows, groups, zero_rows)``: the decode rows (8 ints
    per program) grouped by index dtype, ``(index_dtype, first_row, n_rows)`` per launch, and the zeroing rows."""
    by_dtype = {}
    for idt, v_off, i_off, count, out_off, k, axis, cols in entries:
        progs = by_dtype.setdefault(idt, [])
        for start in range(0, count, DECODE_BLOCK):
            progs.append([v_off, i_off, count, start, out_off, k, axis, cols])
    rows, groups = [], []
    for idt, progs in by_dtype.items():
        groups.append((idt, len(rows), len(progs)))
        rows.extend(progs)
    zero_rows = [[e[4], n, start] for e, n in zip(entries, out_numels) for start in range(0, n, DECODE_BLOCK)]
    return rows, groups, zero_rows


def bucket_decode(rows: torch.Tensor, wire_dtype: torch.dtype, out: torch.Tensor, table: torch.Tensor, groups,
                  zero_table: torch.Tensor, scale: Optional[torch.Tensor]) -> None:
    """Every rank's packed blocks of a bucket summed into ``out``: ``rows`` (``uint8 [world, row_bytes]``, a row
    per rank, each laid out as the tables say) decoded rank after rank, each entry ``value.to(out.dtype) * scale``
    added at its flat position; the tensors' regions of ``out`` are zeroed first. Bit for bit what one
    ``index_add_`` per rank and tensor into zeros gives (``sparsify.sum_in_rank_order``). ``scale``: a one-element
    tensor (float64 for float64 ``out``, else float32) or None. One launch for the zeroing and one per rank and
    index dtype; no host synchronisation."""
    _check(out, "out")
    if rows.dtype != torch.uint8 or rows.dim() != 2 or not rows.is_contiguous():
        raise ValueError("rows must be a contiguous uint8 [world, row_bytes] tensor")
    with _INTERPRETER_LOCK:
        if zero_table.numel():
            _zero_regions_kernel[(zero_table.shape[0],)](out, zero_table, BLOCK=DECODE_BLOCK)
        for r in range(rows.shape[0]):
            row = rows[r]
            for idt, first, n in groups:
                _bucket_decode_kernel[(n,)](row.view(wire_dtype), row.view(idt), out,
                                            scale if scale is not None else out, table[first:first + n],
                                            HAS_SCALE=scale is not None, BLOCK=DECODE_BLOCK)


def _flat_select(a: torch.Tensor, mode: int, t: Optional[torch.Tensor], hist: Optional[torch.Tensor], k: int,
                 cols: int = 1, axis: int = 1, zero: bool = False, known_total: Optional[int] = None,
                 rb: int = RB_STREAM):
    n = a.numel()
    if n == 0:
        if mode == 3:
            return torch.zeros(2, dtype=torch.int64, device=a.device)
        return torch.empty(0, dtype=a.dtype, device=a.device), torch.empty(0, dtype=torch.int64, device=a.device)
    kw, key_bits, inf = _key_params(a.dtype, rb)
    nblocks = triton.cdiv(n, FLAT_BLOCK)
    dummy = a if t is None else t
    state_arg = hist if hist is not None else torch.zeros(1, dtype=torch.int64, device=a.device)
    counts = torch.empty(2 * nblocks, dtype=torch.int64, device=a.device)
    meta = dict(MODE=mode, AXIS=axis, BLOCK=FLAT_BLOCK, RB=rb, KEY_BITS=key_bits, KW=kw, INF=inf)
    _flat_count_kernel[(nblocks,)](a, dummy, state_arg, counts, n, k, cols, **meta)
    if mode == 3:
        return counts
    starts = torch.zeros_like(counts)
    csum = counts.view(nblocks, 2).cumsum(0)
    starts.view(nblocks, 2)[1:] = csum[:-1]
    total = known_total if known_total is not None else int(csum[-1, 0])
    values = torch.empty(total, dtype=a.dtype, device=a.device)
    flat = torch.empty(total, dtype=torch.int64, device=a.device)
    if total > 0 or zero:
        _flat_write_kernel[(nblocks,)](a, dummy, state_arg, starts, values, flat, n, k, cols, ZERO=bool(zero),
                                       **meta)
    return values, flat


def topk_select(a: torch.Tensor, k: int, grad: Optional[torch.Tensor] = None,
                zero_sent: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Exact global top-``k`` of ``|a|`` over the flattened tensor: ``(values, flat)`` (flat int64 ascending).

    Same ordering and tie rule as :func:`adtopk_select`; ``grad`` and ``zero_sent`` as there.
    """
    _check(a)
    grad = _check_grad(a, grad)
    n = a.numel()
    k = int(k)
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, numel={n}], got {k}")
    rb = RB_STREAM
    kw, key_bits, inf = _key_params(a.dtype, rb)
    rounds = key_bits // rb
    hist = torch.zeros(rounds * (1 << rb), dtype=torch.int64, device=a.device)
    state = torch.zeros(2, dtype=torch.int64, device=a.device)  # (prefix, #keys above the prefix's range)
    nblocks = triton.cdiv(n, FLAT_BLOCK)
    for r in range(rounds):
        has_grad = grad is not None and r == 0
        _radix_count_kernel[(nblocks,)](a, grad if has_grad else a, hist, state, n, r, HAS_GRAD=has_grad,
                                        BLOCK=FLAT_BLOCK, RB=rb, KEY_BITS=key_bits, KW=kw, INF=inf)
        _radix_step_kernel[(1,)](hist, state, k, r, RB=rb, KEY_BITS=key_bits, KW=kw)
    return _flat_select(a, 0, None, state, k, zero=zero_sent, known_total=k, rb=rb)


def _threshold_tensor(t, a: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to ``a``'s dtype (the comparison happens in ``a``'s dtype, as in ``selection.py``)."""
    t = torch.as_tensor(t, dtype=torch.float64).to(a.device)
    t = torch.where(t < 0, torch.zeros_like(t), t)  # |a| >= negative t <=> |a| >= 0 (NaN excluded either way)
    return t.to(a.dtype).reshape(-1).contiguous()


def threshold_select(a: torch.Tensor, t) -> Tuple[torch.Tensor, torch.Tensor]:
    """Entries with ``|a| >= t`` plus every non-finite entry: ``(values, flat)``, flat int64 ascending."""
    _check(a)
    return _flat_select(a, 1, _threshold_tensor(t, a), None, 0)


def fiber_threshold_select(a: torch.Tensor, rows: int, cols: int, axis: int,
                           thresholds: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Entries whose ``|a|`` reaches their own fiber's threshold (``thresholds``: ``[num_fibers]``), plus
    every non-finite entry: ``(values, flat)``, flat int64 ascending."""
    _check(a)
    rows, cols, axis = int(rows), int(cols), int(axis)
    if axis not in (0, 1):
        raise ValueError(f"axis must be 0 or 1, got {axis}")
    if rows * cols != a.numel():
        raise ValueError(f"rows * cols = {rows * cols} != a.numel() = {a.numel()}")
    n_fibers = rows if axis == 1 else cols
    thr = _threshold_tensor(thresholds, a)
    if thr.numel() != n_fibers:
        raise ValueError(f"thresholds must have num_fibers = {n_fibers} entries, got {thr.numel()}")
    return _flat_select(a, 2, thr, None, 0, cols=cols, axis=axis)


def count_at_least(a: torch.Tensor, t) -> int:
    """Number of entries with ``|a| >= t`` (NaN never counts, as in ``(a.abs() >= t).sum()``)."""
    _check(a)
    if a.numel() == 0:
        return 0
    counts = _flat_select(a, 3, _threshold_tensor(t, a), None, 0)
    return int(counts.view(-1, 2)[:, 0].sum())
