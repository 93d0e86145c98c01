"""Triton lightning-indexer scores over the paged key cache, and the top-k on them (DeepSeek-V3.2).

Grid (query token, key tile): a program loads BLOCK_N keys of its token's sequence through the block table once and
scores them against every index head, BLOCK_H heads per tl.dot ([BLOCK_H, D] x [D, BLOCK_N]), then relu, times the
heads' weights, summed over heads -> one row segment of the [T, W] fp32 score matrix (W = the block table's width x
block_size, -inf past the token's position). A tile wholly past the position skips the head loop. Each token's
sequence and context come from query_start_loc on the device (mla_attention's token_contexts), so there is no host
sync and padded graph tokens (context 0) score nothing. select_topk then picks index_topk columns per row (ties to
the lower position, naive.py), in row chunks of int64 keys twice the scores' bytes.

The [T, W] matrix is materialized: T x W x 4 bytes (an 8k-token prefill over 8k keys: 256 MiB). A fused per-tile
top-k that keeps only index_topk candidates per row is the next step for long contexts.
"""

from __future__ import annotations

import torch

from gyrfalcon.kernels.common import HAS_TRITON, cdiv, interpreting, next_pow2, tl, triton
from gyrfalcon.kernels.dsa_indexer.naive import select_topk
from gyrfalcon.kernels.mla_attention.triton import token_contexts

if HAS_TRITON:

    @triton.jit
    def _indexer_scores_kernel(
        q_ptr, w_ptr, c_ptr, bt_ptr, seq_ptr, ctx_ptr, o_ptr, n_heads, W,
        s_qt, s_qh, s_wt, s_cb, s_co, s_bt, s_ot,
        D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
    ):
        t = tl.program_id(0)
        kpos = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ctx = tl.load(ctx_ptr + t)
        seq = tl.load(seq_ptr + t).to(tl.int64)
        kmask = kpos < ctx
        dd = tl.arange(0, BLOCK_D)
        phys = tl.load(bt_ptr + seq * s_bt + kpos // BLOCK_SIZE, mask=kmask, other=0).to(tl.int64)
        k = tl.load(c_ptr + phys[:, None] * s_cb + (kpos % BLOCK_SIZE)[:, None] * s_co + dd[None, :],
                    mask=kmask[:, None] & (dd[None, :] < D), other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        acc = tl.zeros([BLOCK_N], tl.float32)
        # No head of a tile past the token's position is scored: its loop runs zero times.
        h_end = tl.where(tl.program_id(1) * BLOCK_N < ctx, n_heads, 0)
        for h0 in range(0, h_end, BLOCK_H):
            heads = h0 + tl.arange(0, BLOCK_H)
            hmask = heads < n_heads
            q = tl.load(q_ptr + t * s_qt + heads[:, None] * s_qh + dd[None, :],
                        mask=hmask[:, None] & (dd[None, :] < D), other=0.0)
            if UPCAST:
                q = q.to(tl.float32)
            else:
                q = q.to(k.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)  # [BLOCK_H, BLOCK_N]
            w = tl.load(w_ptr + t * s_wt + heads, mask=hmask, other=0.0)
            acc += tl.sum(tl.maximum(s, 0.0) * w[:, None], axis=0)
        tl.store(o_ptr + t * s_ot + kpos, tl.where(kmask, acc, float("-inf")), mask=kpos < W)


def indexer_scores_triton(q: torch.Tensor, w: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                          seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *, block_n: int = 64,
                          block_h: int = 16) -> torch.Tensor:
    """The contract of indexer_scores_ref: q [T, H, D], w [T, H] fp32, cache [num_blocks, block_size, 1, D] ->
    [T, W] fp32. block_n / block_h: the tiles (tests)."""
    assert q.dim() == 3 and q.stride(-1) == 1 and cache.stride(-1) == 1 and block_tables.stride(-1) == 1
    T, H, D = q.shape
    block_size = cache.shape[1]
    W = block_tables.shape[1] * block_size
    out = torch.empty(T, W, dtype=torch.float32, device=q.device)
    if T == 0 or W == 0:
        return out
    if seq_lens.shape[0] == 0:
        return out.fill_(float("-inf"))
    seq, ctx = token_contexts(query_start_loc, seq_lens, T)
    w = w.float().contiguous()
    block_n = max(16, next_pow2(block_n))
    _indexer_scores_kernel[(T, cdiv(W, block_n))](
        q, w, cache, block_tables, seq, ctx, out, H, W,
        q.stride(0), q.stride(1), w.stride(0), cache.stride(0), cache.stride(1), block_tables.stride(0),
        out.stride(0),
        D=D, BLOCK_SIZE=block_size, BLOCK_H=max(16, next_pow2(min(block_h, H))), BLOCK_D=max(16, next_pow2(D)),
        BLOCK_N=block_n, DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32", UPCAST=interpreting(),
        num_warps=4,
    )
    return out


def indexer_topk_triton(q: torch.Tensor, w: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, query_start_loc: torch.Tensor, index_topk: int) -> torch.Tensor:
    """The contract of indexer_topk_ref: the Triton scores, then torch.topk on the device -> int32 [T, index_topk]."""
    return select_topk(indexer_scores_triton(q, w, cache, block_tables, seq_lens, query_start_loc), index_topk)
