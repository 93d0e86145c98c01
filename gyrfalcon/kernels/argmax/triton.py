"""The two-stage Triton argmax (stage 1: a chunk of a row per program; stage 2: a row's chunks)."""

from __future__ import annotations

import torch

from gyrfalcon.kernels.argmax.configs import BLOCK, MIN_CHUNK, NUM_WARPS, TARGET_PROGRAMS, split_rows
from gyrfalcon.kernels.common import HAS_TRITON, next_pow2, tl, triton


if HAS_TRITON:

    @triton.jit
    def _argmax_key(x):
        """fp32 -> int32 key, ordered as the floats are; NaN above +inf; -0.0 == +0.0. Integer tests
        only, so that no float compare (and no flush of subnormals to zero) is involved."""
        b = x.to(tl.int32, bitcast=True)
        mag = b & 0x7FFFFFFF
        k = tl.where(mag == 0, 0, b ^ ((b >> 31) & 0x7FFFFFFF))
        return tl.where(mag > 0x7F800000, 0x7FFFFFFF, k)

    @triton.jit
    def _argmax_partial_kernel(x_ptr, part_ptr, out_ptr, V, stride_x, chunk, P,
                               BLOCK: tl.constexpr, FINAL: tl.constexpr):
        # Grid (S, P). Program (row, p) scans [p * chunk, (p + 1) * chunk) of its row.
        row = tl.program_id(0)
        p = tl.program_id(1)
        lo = p * chunk
        offs = tl.arange(0, BLOCK)
        base = x_ptr + row.to(tl.int64) * stride_x
        best_k = tl.full([BLOCK], -2147483648, tl.int32)  # below key(-inf): any element replaces it
        best_i = tl.zeros([BLOCK], tl.int32) + V
        for start in range(0, chunk, BLOCK):
            idx = lo + start + offs
            mask = idx < V
            x = tl.load(base + idx, mask=mask, other=float("-inf")).to(tl.float32)
            k = _argmax_key(x)
            take = mask & (k > best_k)  # strictly greater: a lane keeps its first maximum
            best_k = tl.where(take, k, best_k)
            best_i = tl.where(take, idx, best_i)
        m = tl.max(best_k, axis=0)
        i = tl.min(tl.where(best_k == m, best_i, V), axis=0)
        if FINAL:
            tl.store(out_ptr + row, i.to(tl.int64))
        else:
            # part: [2, S, P] int32, keys then indices.
            n = tl.num_programs(0) * P
            tl.store(part_ptr + row * P + p, m)
            tl.store(part_ptr + n + row * P + p, i)

    @triton.jit
    def _argmax_reduce_kernel(part_ptr, out_ptr, P, V, BLOCK_P: tl.constexpr):
        # Grid (S,): the row's P partials, in chunk order.
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK_P)
        mask = offs < P
        n = tl.num_programs(0) * P
        k = tl.load(part_ptr + row * P + offs, mask=mask, other=-2147483648)
        i = tl.load(part_ptr + n + row * P + offs, mask=mask, other=V)
        m = tl.max(k, axis=0)
        tl.store(out_ptr + row, tl.min(tl.where(mask & (k == m), i, V), axis=0).to(tl.int64))


def greedy_argmax_triton(logits: torch.Tensor, block: int = BLOCK, min_chunk: int = MIN_CHUNK,
                         target_programs: int = TARGET_PROGRAMS, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """The two-stage kernel at any S (argmax_launch's torch cut-over is the dispatcher's business)."""
    assert logits.dim() == 2 and logits.is_floating_point()
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    S, V = logits.shape
    out = torch.empty(S, dtype=torch.int64, device=logits.device)
    if S == 0:
        return out
    assert 0 < V < 2**31 - 1, V
    chunk, P = split_rows(S, V, block, min_chunk, target_programs)
    if P == 1:
        _argmax_partial_kernel[(S, 1)](logits, out, out, V, logits.stride(0), chunk, 1,
                                       BLOCK=block, FINAL=True, num_warps=num_warps)
        return out
    part = torch.empty(2 * S * P, dtype=torch.int32, device=logits.device)
    _argmax_partial_kernel[(S, P)](logits, part, out, V, logits.stride(0), chunk, P,
                                   BLOCK=block, FINAL=False, num_warps=num_warps)
    BLOCK_P = max(16, next_pow2(P))
    _argmax_reduce_kernel[(S,)](part, out, P, V, BLOCK_P=BLOCK_P, num_warps=1 if BLOCK_P <= 128 else 4)
    return out
