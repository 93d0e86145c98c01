"""Triton split-K decode attention over the paged MLA latent cache (one query per sequence, absorbed form).

Grid (sequence, head block, split): each program scores BLOCK_H heads' [latent | rope] queries against the rows of
its split of the context (one shared row per key: MQA, so a K/V tile loaded once serves every head of the block),
keeps an online softmax, and accumulates p @ latent. With one split it writes the normalized output; otherwise
its normalized partial and log2-sum-exp go to a buffer that the reduce kernel merges. Splits and buffers are sized
from shapes (the block table's width), never from the lengths, so no host sync happens (CUDA-graph safe).

Sparse MLA (DeepSeek-V3.2, SPARSE): the keys are the row's list of selected positions (indices [B, K], -1: none)
instead of 0 .. seq_len - 1; the splits divide the list (sized from K), each key is gathered through the block
table as before, and a position outside the context is masked (never read).
"""

from __future__ import annotations

import torch

from gyrfalcon.kernels.common import (HAS_TRITON, cdiv, gdc_launch_dependents, gdc_wait, interpreting, next_pow2,
                                      pdl_launch_kwargs, tl, triton, use_pdl)
from gyrfalcon.kernels.decode_attention.configs import default_num_splits

if HAS_TRITON:
    from gyrfalcon.kernels.paged_attention.triton import _find_seq

_LOG2E = 1.4426950408889634

if HAS_TRITON:

    # The split count follows the batch (decode_attention's rule; per-token prefill rows make the batch the token
    # count): not specialized, so a new batch shape compiles no new variant mid-run.
    @triton.jit(do_not_specialize=["num_splits"])
    def _mla_decode_split_kernel(
        q_ptr, c_ptr, bt_ptr, sl_ptr, idx_ptr, o_ptr, po_ptr, plse_ptr, scale_log2, n_heads, num_splits, n_idx,
        s_qb, s_qh, s_cb, s_co, s_ob, s_oh, s_bt, s_idx,
        L: tl.constexpr, R: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
        BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr,
        DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, SPARSE: tl.constexpr, USE_PDL: tl.constexpr = False,
    ):
        if USE_PDL:  # batch-1 decode graphs: the next kernel may launch; wait for the previous before any load
            gdc_launch_dependents()
            gdc_wait()
        b = tl.program_id(0)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        split = tl.program_id(2)
        hmask = heads < n_heads
        dl = tl.arange(0, BLOCK_L)
        dr = tl.arange(0, BLOCK_R)
        seq_len = tl.load(sl_ptr + b)
        # The keys visited: the context, or (sparse) the row's index list, whose -1 entries are masked below.
        if SPARSE:
            span = tl.where(seq_len > 0, n_idx, 0)
        else:
            span = seq_len
        # Each split covers a whole number of key tiles; trailing splits of a short context stay empty.
        part = tl.cdiv(tl.cdiv(span, num_splits), BLOCK_N) * BLOCK_N
        start = split * part
        end = tl.minimum(start + part, span)

        q_row = q_ptr + b * s_qb + heads[:, None] * s_qh
        q_lat = tl.load(q_row + dl[None, :], mask=hmask[:, None] & (dl[None, :] < L), other=0.0)
        q_pe = tl.load(q_row + L + dr[None, :], mask=hmask[:, None] & (dr[None, :] < R), other=0.0)
        if UPCAST:
            q_lat = q_lat.to(tl.float32)
            q_pe = q_pe.to(tl.float32)

        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
        bt_row = bt_ptr + b * s_bt
        for kstart in range(start, end, BLOCK_N):
            kpos = kstart + tl.arange(0, BLOCK_N)
            kmask = kpos < end
            if SPARSE:
                kpos = tl.load(idx_ptr + b * s_idx + kpos, mask=kmask, other=-1)
                kmask = kmask & (kpos >= 0) & (kpos < seq_len)
                kpos = tl.where(kmask, kpos, 0)
            phys = tl.load(bt_row + kpos // BLOCK_SIZE, mask=kmask, other=0).to(tl.int64)
            row = c_ptr + phys * s_cb + (kpos % BLOCK_SIZE) * s_co
            kv = tl.load(row[:, None] + dl[None, :], mask=kmask[:, None] & (dl[None, :] < L), other=0.0)
            kpe = tl.load(row[:, None] + L + dr[None, :], mask=kmask[:, None] & (dr[None, :] < R), other=0.0)
            if UPCAST:
                kv = kv.to(tl.float32)
                kpe = kpe.to(tl.float32)
            else:
                kv = kv.to(q_lat.dtype)
                kpe = kpe.to(q_lat.dtype)
            s = tl.dot(q_lat, tl.trans(kv), input_precision=DOT_PREC)
            s += tl.dot(q_pe, tl.trans(kpe), input_precision=DOT_PREC)
            s = tl.where(kmask[None, :], s * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            if SPARSE:
                # A tile of only unselected entries can come before any key: keep exp2(-inf - -inf) out (p = 0).
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            else:
                m_ref = m_new
            p = tl.math.exp2(s - m_ref[:, None])
            alpha = tl.math.exp2(m_i - m_ref)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision=DOT_PREC)
            m_i = m_new

        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        if DIRECT:
            tl.store(o_ptr + b * s_ob + heads[:, None] * s_oh + dl[None, :], out.to(o_ptr.dtype.element_ty),
                     mask=hmask[:, None] & (dl[None, :] < L))
        else:
            # Partials [B, H, S, BLOCK_L] fp32 normalized, lse [B, H, S] in log2 units (-inf: an empty split).
            prow = (b * n_heads + heads) * num_splits + split
            tl.store(po_ptr + prow[:, None] * BLOCK_L + dl[None, :], out, mask=hmask[:, None])
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
            tl.store(plse_ptr + prow, lse, mask=hmask)

    @triton.jit(do_not_specialize=["num_splits"])
    def _mla_decode_reduce_kernel(po_ptr, plse_ptr, o_ptr, num_splits, s_ob, s_oh,
                                  L: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_S: tl.constexpr,
                                  USE_PDL: tl.constexpr = False):
        if USE_PDL:
            gdc_launch_dependents()
            gdc_wait()
        b = tl.program_id(0)
        h = tl.program_id(1)
        n_heads = tl.num_programs(1)
        sp = tl.arange(0, BLOCK_S)
        dl = tl.arange(0, BLOCK_L)
        prow = (b * n_heads + h) * num_splits + sp
        smask = sp < num_splits
        lse = tl.load(plse_ptr + prow, mask=smask, other=float("-inf"))
        m = tl.max(lse, axis=0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        w = tl.math.exp2(lse - m_safe)  # 0 for empty splits
        parts = tl.load(po_ptr + prow[:, None] * BLOCK_L + dl[None, :], mask=(smask & (lse > float("-inf")))[:, None],
                        other=0.0)
        den = tl.sum(w, axis=0)
        out = tl.sum(parts * w[:, None], axis=0) / tl.where(den == 0.0, 1.0, den)
        tl.store(o_ptr + b * s_ob + h * s_oh + dl, out.to(o_ptr.dtype.element_ty), mask=dl < L)

    # The sequence count changes from batch to batch: not specialized (see paged_attention's prefill kernel).
    @triton.jit(do_not_specialize=["num_seqs"])
    def _mla_prefill_tiled_kernel(
        q_ptr, c_ptr, bt_ptr, sl_ptr, qsl_ptr, o_ptr, scale_log2, n_heads, num_seqs,
        s_qt, s_qh, s_cb, s_co, s_ot, s_oh, s_bt,
        L: tl.constexpr, R: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr,
        BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        """Grid (num_tokens // BLOCK_Q + num_seqs, head blocks): a program owns BLOCK_Q query tokens of one sequence
        times BLOCK_H heads (rows token-major, head-minor), so each [BLOCK_N, L + R] tile of latent rows read from
        the paged cache serves BLOCK_Q x BLOCK_H query rows; keys 0 .. the tile's last position, masked causally per
        row. Query blocks run in reverse, the longest contexts first."""
        q_block = tl.num_programs(0) - 1 - tl.program_id(0)
        seq = _find_seq(qsl_ptr, num_seqs, q_block, BLOCK_Q)
        q_start = tl.load(qsl_ptr + seq)
        q_len = tl.load(qsl_ptr + seq + 1) - q_start
        local = q_block - (q_start // BLOCK_Q + seq)
        if local * BLOCK_Q >= q_len:
            return
        ctx = tl.load(sl_ptr + seq) - q_len
        BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_H
        rows = tl.arange(0, BLOCK_M)
        q_idx = local * BLOCK_Q + rows // BLOCK_H
        head = tl.program_id(1) * BLOCK_H + rows % BLOCK_H
        row_ok = (q_idx < q_len) & (head < n_heads)
        q_pos = ctx + q_idx
        dl = tl.arange(0, BLOCK_L)
        dr = tl.arange(0, BLOCK_R)
        q_row = q_ptr + (q_start + q_idx).to(tl.int64)[:, None] * s_qt + head[:, None] * s_qh
        q_lat = tl.load(q_row + dl[None, :], mask=row_ok[:, None] & (dl[None, :] < L), other=0.0)
        q_pe = tl.load(q_row + L + dr[None, :], mask=row_ok[:, None] & (dr[None, :] < R), other=0.0)
        if UPCAST:
            q_lat = q_lat.to(tl.float32)
            q_pe = q_pe.to(tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_L], tl.float32)
        kv_end = ctx + tl.minimum((local + 1) * BLOCK_Q, q_len)
        bt_row = bt_ptr + seq.to(tl.int64) * s_bt
        for start in range(0, kv_end, BLOCK_N):
            kpos = start + tl.arange(0, BLOCK_N)
            kmask = kpos < kv_end
            phys = tl.load(bt_row + kpos // BLOCK_SIZE, mask=kmask, other=0).to(tl.int64)
            crow = c_ptr + phys * s_cb + (kpos % BLOCK_SIZE) * s_co
            kv = tl.load(crow[:, None] + dl[None, :], mask=kmask[:, None] & (dl[None, :] < L), other=0.0)
            kpe = tl.load(crow[:, None] + L + dr[None, :], mask=kmask[:, None] & (dr[None, :] < R), other=0.0)
            if UPCAST:
                kv = kv.to(tl.float32)
                kpe = kpe.to(tl.float32)
            else:
                kv = kv.to(q_lat.dtype)
                kpe = kpe.to(q_lat.dtype)
            s = tl.dot(q_lat, tl.trans(kv), input_precision=DOT_PREC)
            s += tl.dot(q_pe, tl.trans(kpe), input_precision=DOT_PREC)
            s = tl.where(kmask[None, :] & (kpos[None, :] <= q_pos[:, None]), s * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a padded row sees nothing: p = 0, not NaN
            p = tl.math.exp2(s - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision=DOT_PREC)
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(o_ptr + (q_start + q_idx).to(tl.int64)[:, None] * s_ot + head[:, None] * s_oh + dl[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & (dl[None, :] < L))


def _decode_config(kv_lora_rank: int):
    """(BLOCK_H heads, BLOCK_N keys, num_warps) per program: the [BLOCK_H, L] fp32 accumulator and a
    [BLOCK_N, L + R] key tile must fit one SM at the real model's L = 512 (untuned)."""
    if kv_lora_rank >= 256:
        return 16, 32, 8
    return 16, 32, 4


def mla_decode_triton(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      scale: float, kv_lora_rank: int, num_splits: int | None = None, *,
                      indices: torch.Tensor | None = None, block_h: int | None = None,
                      block_n: int | None = None, pdl: bool | None = None) -> torch.Tensor:
    """Split-K MLA decode; the contract of mla_decode_ref: q [B, H, L + R], cache [num_blocks, block_size, 1,
    L + R] -> o [B, H, L] in q.dtype (seq_len 0: zeros). indices: int32 [B, K], each row's selected key positions
    (-1: none; sparse MLA), None: the whole context. num_splits None: from the batch shape and the keys a row
    visits (the block table's width, or K; decode_attention's rule, with head blocks as the per-sequence
    programs); block_h / block_n override the tiles (tests); pdl: programmatic dependent launch (default:
    use_pdl(q), batch-1 decode graphs)."""
    assert q.dim() == 3 and q.stride(-1) == 1 and cache.stride(-1) == 1 and block_tables.stride(-1) == 1
    B, H, D = q.shape
    L = kv_lora_rank
    R = D - L
    assert cache.shape[-1] == D and cache.shape[2] == 1
    o = torch.empty(B, H, L, dtype=q.dtype, device=q.device)
    if B == 0:
        return o
    bh, bn, nw = _decode_config(L)
    bh, bn = max(16, block_h or bh), max(16, block_n or bn)
    n_hblocks = cdiv(H, bh)
    block_size = cache.shape[1]
    sparse = indices is not None
    if sparse:
        assert indices.dim() == 2 and indices.shape[0] == B and indices.stride(-1) == 1
    if num_splits is None:
        span = indices.shape[1] if sparse else block_tables.shape[1] * block_size
        num_splits = default_num_splits(B, n_hblocks, span, q.device)
    num_splits = max(1, int(num_splits))
    direct = num_splits == 1
    block_l = max(16, next_pow2(L))
    if direct:
        po = plse = o  # unused
    else:
        po = torch.empty(B * H * num_splits, block_l, dtype=torch.float32, device=q.device)
        plse = torch.empty(B * H * num_splits, dtype=torch.float32, device=q.device)
    pdl = use_pdl(q) if pdl is None else pdl
    _mla_decode_split_kernel[(B, n_hblocks, num_splits)](
        q, cache, block_tables, seq_lens, indices if sparse else seq_lens, o, po, plse, float(scale) * _LOG2E, H,
        num_splits, indices.shape[1] if sparse else 0,
        q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), o.stride(0), o.stride(1), block_tables.stride(0),
        indices.stride(0) if sparse else 0,
        L=L, R=R, BLOCK_SIZE=block_size, BLOCK_H=bh, BLOCK_L=block_l, BLOCK_R=max(16, next_pow2(R)), BLOCK_N=bn,
        DIRECT=direct, DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32", UPCAST=interpreting(),
        SPARSE=sparse, USE_PDL=pdl, num_warps=nw, num_stages=2, **pdl_launch_kwargs(pdl),
    )
    if not direct:
        _mla_decode_reduce_kernel[(B, H)](po, plse, o, num_splits, o.stride(0), o.stride(1), L=L, BLOCK_L=block_l,
                                          BLOCK_S=next_pow2(num_splits), USE_PDL=pdl, num_warps=4,
                                          **pdl_launch_kwargs(pdl))
    return o


def mla_prefill_triton(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                       query_start_loc: torch.Tensor, scale: float, kv_lora_rank: int, num_splits: int | None = None,
                       indices: torch.Tensor | None = None, **tiles) -> torch.Tensor:
    """Causal varlen MLA (prefill chunks, mixed and verify steps); the contract of mla_attention_ref. Each query
    token runs as a decode row of its own: its sequence's block table and a context ending at its position
    (seq_len - (query end - token) + 1), found on the device (no host sync), and its row of indices (sparse MLA).
    Tokens past query_start_loc[-1] (a padded graph's) get context 0: zeros. Every token streams its own keys, so
    long prompts re-read the prefix once per token: correct at any length, but no tiled prefill kernel yet."""
    T, B = q.shape[0], seq_lens.shape[0]
    if T == 0 or B == 0:
        return q.new_zeros(T, q.shape[1], kv_lora_rank)
    seq, ctx = token_contexts(query_start_loc, seq_lens, T)
    return mla_decode_triton(q, cache, block_tables[seq], ctx, scale, kv_lora_rank, num_splits, indices=indices,
                             **tiles)


def _prefill_tiles(n_heads: int, kv_lora_rank: int):
    """(BLOCK_Q tokens, BLOCK_H heads, BLOCK_N keys, num_warps) of the tiled prefill (untuned): 32 query rows a
    program keep its [rows, L] fp32 accumulator and a [BLOCK_N, L + R] key tile on one SM at L = 512; with many heads
    the rows go to heads (each key tile then serves 2 tokens x 16 heads), with few to tokens."""
    block_h = min(16, next_pow2(n_heads))
    rows = 32 if kv_lora_rank >= 256 else 64
    return max(1, rows // block_h), block_h, 32, 8 if kv_lora_rank >= 256 else 4


def mla_prefill_tiled_triton(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                             seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, kv_lora_rank: int,
                             *, block_q: int | None = None, block_h: int | None = None,
                             block_n: int | None = None) -> torch.Tensor:
    """Dense causal varlen MLA with query tiles (prefill chunks, mixed and verify steps); the contract of
    mla_attention_ref without indices. A program takes BLOCK_Q tokens x BLOCK_H heads of one sequence and streams
    its keys once for all of them (mla_prefill_triton streams them once per token). The grid is sized from shapes
    (num_tokens // BLOCK_Q + num_seqs query blocks), no host sync; tokens past query_start_loc[-1] (a padded
    graph's) get zeros. block_q / block_h / block_n override the tiles (tests)."""
    assert q.dim() == 3 and q.stride(-1) == 1 and cache.stride(-1) == 1 and block_tables.stride(-1) == 1
    T, H, D = q.shape
    L = kv_lora_rank
    R = D - L
    assert cache.shape[-1] == D and cache.shape[2] == 1
    B = seq_lens.shape[0]
    o = torch.zeros(T, H, L, dtype=q.dtype, device=q.device)  # zeros: rows no program owns (padding)
    if T == 0 or B == 0:
        return o
    bq, bh, bn, nw = _prefill_tiles(H, L)
    bq, bh, bn = block_q or bq, block_h or bh, max(16, block_n or bn)
    assert bq * bh >= 16 and (bq * bh) & (bq * bh - 1) == 0, "BLOCK_Q x BLOCK_H: a power of two of 16 or more rows"
    _mla_prefill_tiled_kernel[(T // bq + B, cdiv(H, bh))](
        q, cache, block_tables, seq_lens, query_start_loc, o, float(scale) * _LOG2E, H, B,
        q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), o.stride(0), o.stride(1), block_tables.stride(0),
        L=L, R=R, BLOCK_SIZE=cache.shape[1], BLOCK_Q=bq, BLOCK_H=bh, BLOCK_L=max(16, next_pow2(L)),
        BLOCK_R=max(16, next_pow2(R)), BLOCK_N=bn, DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=interpreting(), num_warps=nw, num_stages=2,
    )
    return o


def token_contexts(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int):
    """Each query token's sequence and causal context, on the device (no host sync) -> (seq int64 [T], ctx int32
    [T]): ctx = its position + 1; tokens past query_start_loc[-1] (a padded graph's) get seq 0 and ctx 0."""
    B = seq_lens.shape[0]
    tok = torch.arange(num_tokens, device=seq_lens.device, dtype=query_start_loc.dtype)
    seq = torch.searchsorted(query_start_loc[1:].contiguous(), tok, right=True)
    valid = seq < B
    seq = seq.clamp(max=B - 1)
    ctx = seq_lens[seq] - (query_start_loc[seq + 1] - tok) + 1
    return seq, torch.where(valid, ctx, torch.zeros_like(ctx)).to(torch.int32)
