"""Triton embedding_with_pending: one program per (token, column block)."""

from __future__ import annotations

import torch

from gyrfalcon.kernels.common import HAS_TRITON, next_pow2, tl, triton


if HAS_TRITON:

    @triton.jit
    def _embedding_with_pending_kernel(w_ptr, ids_ptr, src_ptr, last_ptr, out_ptr, H, stride_w, stride_o,
                                       BLOCK: tl.constexpr):
        # Grid: (tokens, column blocks of H).
        t = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        s = tl.load(src_ptr + t)
        tok = tl.load(ids_ptr + t)
        if s >= 0:
            tok = tl.load(last_ptr + s)
        row = tl.load(w_ptr + tok * stride_w + cols, mask=mask)
        tl.store(out_ptr + t * stride_o + cols, row, mask=mask)


def embedding_with_pending_triton(weight: torch.Tensor, input_ids: torch.Tensor, src: torch.Tensor,
                                  last_sampled: torch.Tensor) -> torch.Tensor:
    """Triton embedding_with_pending; same contract as the reference. No host sync: graph-capturable."""
    T, H = input_ids.shape[0], weight.shape[1]
    out = torch.empty(T, H, dtype=weight.dtype, device=weight.device)
    if T == 0:
        return out
    assert weight.stride(1) == 1 and src.shape[0] == T
    BLOCK = min(1024, max(16, next_pow2(H)))
    _embedding_with_pending_kernel[(T, triton.cdiv(H, BLOCK))](
        weight, input_ids, src, last_sampled, out, H, weight.stride(0), out.stride(0),
        BLOCK=BLOCK, num_warps=4)
    return out
