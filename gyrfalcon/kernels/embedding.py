"""Token embedding lookup that first resolves tokens still on the device, in one launch.

A decode step scheduled ahead of the device (async scheduling) does not know the token each sequence
sampled in the step before; the runner's `last_sampled` buffer holds it on the device, and `src` says
which row of it each token takes. In torch that is clamp, index, compare, where, then the embedding
gather: five kernels of ~1-2 us each in every decode graph (and F.embedding's indexSelectSmallIndex
took 12 us for 16 rows on the H200). Here one program per
(token, column block) picks the token id and copies its row.

weight: [V, H]; input_ids: [T] int64; src: [T] int64 (-1: take input_ids[t], else last_sampled[src[t]]);
last_sampled: [S] int64. Returns [T, H] in weight.dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gyrfalcon.kernels._common import HAS_TRITON, next_pow2, tl, triton, use_triton


def embedding_with_pending_ref(weight: torch.Tensor, input_ids: torch.Tensor, src: torch.Tensor,
                               last_sampled: torch.Tensor) -> torch.Tensor:
    """The torch composition (what the decode graphs ran before this kernel)."""
    ids = torch.where(src >= 0, last_sampled[src.clamp(min=0)], input_ids)
    return F.embedding(ids, weight)


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


def embedding_with_pending(weight: torch.Tensor, input_ids: torch.Tensor, src: torch.Tensor,
                           last_sampled: torch.Tensor) -> torch.Tensor:
    if use_triton(weight):
        return embedding_with_pending_triton(weight, input_ids, src, last_sampled)
    return embedding_with_pending_ref(weight, input_ids, src, last_sampled)
