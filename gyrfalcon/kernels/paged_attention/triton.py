"""Triton flash attention over the paged cache for varlen causal batches (prefill, chunked prefill, mixed)."""

from __future__ import annotations

import torch

from gyrfalcon.kernels.common import HAS_TRITON, interpreting, next_pow2, tl, triton
from gyrfalcon.kernels.paged_attention.configs import prefill_config


_LOG2E = 1.4426950408889634


if HAS_TRITON:

    @triton.jit
    def _find_seq(qsl_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
        # Sequence i owns global q blocks [qsl[i] // BLOCK_Q + i, qsl[i+1] // BLOCK_Q + i + 1): an
        # upper bound of cdiv(q_len, BLOCK_Q) blocks per sequence that needs no host sync to size
        # the grid. Binary search for the last i whose first block is <= q_block.
        lo: tl.int32 = 0
        hi = num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            first = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
            if first <= q_block:
                lo = mid + 1
            else:
                hi = mid
        return lo - 1

    @triton.jit
    def _prefill_step(
        acc, m_i, l_i, q, q_pos, kc_ptr, vc_ptr, bt_row, start, kv_end, kvh, scale_log2,
        s_kb, s_ko, s_kh, s_vb, s_vo, s_vh,
        BLOCK_SIZE: tl.constexpr, HEAD_DK: tl.constexpr, HEAD_DV: tl.constexpr,
        BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
        DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, MASKED: tl.constexpr,
    ):
        # One BLOCK_N-key step of online softmax. MASKED=False is for tiles wholly below the causal
        # diagonal (every row sees every key): no masks on loads or scores there.
        kpos = start + tl.arange(0, BLOCK_N)
        dk = tl.arange(0, BLOCK_DK)
        dv = tl.arange(0, BLOCK_DV)
        kmask = kpos < kv_end
        # Per-key block lookup: BLOCK_N is independent of the cache's block_size.
        if MASKED:
            phys = tl.load(bt_row + kpos // BLOCK_SIZE, mask=kmask, other=0)
        else:
            phys = tl.load(bt_row + kpos // BLOCK_SIZE)
        phys = phys.to(tl.int64)
        off = kpos % BLOCK_SIZE
        k_ptrs = kc_ptr + (phys * s_kb + off * s_ko + kvh * s_kh)[None, :] + dk[:, None]
        v_ptrs = vc_ptr + (phys * s_vb + off * s_vo + kvh * s_vh)[:, None] + dv[None, :]
        if MASKED:
            k = tl.load(k_ptrs, mask=kmask[None, :] & (dk[:, None] < HEAD_DK), other=0.0)
            v = tl.load(v_ptrs, mask=kmask[:, None] & (dv[None, :] < HEAD_DV), other=0.0)
        else:
            if HEAD_DK == BLOCK_DK:
                k = tl.load(k_ptrs)
            else:
                k = tl.load(k_ptrs, mask=dk[:, None] < HEAD_DK, other=0.0)
            if HEAD_DV == BLOCK_DV:
                v = tl.load(v_ptrs)
            else:
                v = tl.load(v_ptrs, mask=dv[None, :] < HEAD_DV, other=0.0)
        if k.dtype == tl.float8e4nv:  # an fp8 cache: the tiles widen to the query's dtype (fp16 or fp32) for the dots
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision=DOT_PREC)
        if MASKED:
            s = tl.where(kmask[None, :] & (kpos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale_log2)
        # A row with nothing visible yet keeps m = -inf; use 0 so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s * scale_log2 - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p = p.to(v.dtype)
        if UPCAST:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PREC)
        return acc, m_new, l_i

    # The sequence count changes from batch to batch: not specialized on (1, a multiple of 16 and the rest
    # would each compile their own variant, mid-run; it only bounds the search for a program's sequence).
    @triton.jit(do_not_specialize=["num_seqs"])
    def _paged_prefill_kernel(
        q_ptr, kc_ptr, vc_ptr, o_ptr, bt_ptr, seq_lens_ptr, qsl_ptr,
        scale_log2, num_seqs,
        s_qt, s_qh, s_ot, s_oh,
        s_kb, s_ko, s_kh, s_vb, s_vo, s_vh, s_bt,
        BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DK: tl.constexpr, HEAD_DV: tl.constexpr,
        BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
    ):
        # Grid: (num_tokens // BLOCK_Q + num_seqs, num_kv_heads). A program owns BLOCK_Q query
        # tokens of one sequence times the GROUP query heads of one kv head (rows = token-major,
        # head-minor), so every K/V tile read from the paged cache serves the whole GQA group.
        # Blocks run in reverse so the longest (latest) query tiles start first: a shorter tail.
        q_block = tl.num_programs(0) - 1 - tl.program_id(0)
        kvh = tl.program_id(1)
        seq = _find_seq(qsl_ptr, num_seqs, q_block, BLOCK_Q)
        q_start = tl.load(qsl_ptr + seq)
        q_len = tl.load(qsl_ptr + seq + 1) - q_start
        local = q_block - (q_start // BLOCK_Q + seq)
        if local * BLOCK_Q >= q_len:
            return
        seq_len = tl.load(seq_lens_ptr + seq)
        ctx = seq_len - q_len

        rows = tl.arange(0, BLOCK_M)
        q_idx = local * BLOCK_Q + rows // GROUP
        head = kvh * GROUP + rows % GROUP
        row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
        q_pos = ctx + q_idx

        dk = tl.arange(0, BLOCK_DK)
        dv = tl.arange(0, BLOCK_DV)
        q = tl.load(
            q_ptr + (q_start + q_idx)[:, None] * s_qt + head[:, None] * s_qh + dk[None, :],
            mask=row_ok[:, None] & (dk[None, :] < HEAD_DK), other=0.0,
        )
        if (kc_ptr.dtype.element_ty == tl.float8e4nv) & (q.dtype != tl.float32):
            # An fp8 cache beside a 16-bit query: the dots run in fp16, which holds every e4m3 value exactly, so
            # the tiles widen in one instruction a pair (cvt.rn.f16x2.e4m3x2) where widening to bf16 went on
            # through fp16 (one F2F.BF16.F16 per value: 64 of the 422 instructions a 32-key step on sm_90,
            # scripts/compile_check.py --sass). A bf16 query is exact in fp16 between 2^-14 and 65504 in
            # magnitude; the decode kernel does the same (Q16).
            q = q.to(tl.float16)
        if UPCAST:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

        # Keys 0 .. (last query position of this tile) are all this tile can see; keys up to its
        # first query position are seen by every row, so whole BLOCK_N tiles below that need no mask.
        kv_end = ctx + tl.minimum((local + 1) * BLOCK_Q, q_len)
        full_end = (ctx + local * BLOCK_Q + 1) // BLOCK_N * BLOCK_N
        bt_row = bt_ptr + seq.to(tl.int64) * s_bt
        for start in range(0, full_end, BLOCK_N):
            acc, m_i, l_i = _prefill_step(
                acc, m_i, l_i, q, q_pos, kc_ptr, vc_ptr, bt_row, start, kv_end, kvh, scale_log2,
                s_kb, s_ko, s_kh, s_vb, s_vo, s_vh,
                BLOCK_SIZE, HEAD_DK, HEAD_DV, BLOCK_DK, BLOCK_DV, BLOCK_N, DOT_PREC, UPCAST, False,
            )
        for start in range(full_end, kv_end, BLOCK_N):
            acc, m_i, l_i = _prefill_step(
                acc, m_i, l_i, q, q_pos, kc_ptr, vc_ptr, bt_row, start, kv_end, kvh, scale_log2,
                s_kb, s_ko, s_kh, s_vb, s_vo, s_vh,
                BLOCK_SIZE, HEAD_DK, HEAD_DV, BLOCK_DK, BLOCK_DV, BLOCK_N, DOT_PREC, UPCAST, True,
            )

        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        tl.store(
            o_ptr + (q_start + q_idx)[:, None] * s_ot + head[:, None] * s_oh + dv[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=row_ok[:, None] & (dv[None, :] < HEAD_DV),
        )


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Triton flash-attention over the paged cache; same contract as paged_attention_ref.

    The grid is sized from shapes alone (num_tokens // BLOCK_Q + num_seqs q blocks), so no host sync
    happens; max_query_len (a host int, or None: num_tokens bounds it) picks the short-query tiles,
    max_seq_len is accepted but not needed. block_m / block_n override
    the tile sizes (tests use small ones to cover many tiles cheaply); num_warps / num_stages
    likewise override the launch config (benchmarks sweep them).
    """
    assert q.dim() == 3 and q.stride(-1) == 1
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    num_tokens, n_heads, dk = q.shape
    n_kv = k_cache.shape[2]
    dv = v_cache.shape[-1]
    assert n_heads % n_kv == 0, "num_heads must be a multiple of num_kv_heads"
    group = n_heads // n_kv
    num_seqs = seq_lens.shape[0]
    o = torch.empty(num_tokens, n_heads, dv, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return o
    # Without a host-side max_query_len, the token count bounds every query (no sync to learn more).
    bm, bn, nw, ns = prefill_config(max(dk, dv), group, num_tokens if max_query_len is None else max_query_len)
    bm, bn, nw, ns = block_m or bm, block_n or bn, num_warps or nw, num_stages or ns
    group_p2 = next_pow2(group)
    # BLOCK_Q tokens x GROUP heads per program; at least 16 rows for tl.dot.
    block_q = max(1, bm // group_p2)
    block_m_rows = max(16, next_pow2(block_q * group))
    grid = (num_tokens // block_q + num_seqs, n_kv)
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, o, block_tables, seq_lens, query_start_loc,
        float(scale) * _LOG2E, num_seqs,
        q.stride(0), q.stride(1), o.stride(0), o.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        BLOCK_SIZE=k_cache.shape[1], GROUP=group, HEAD_DK=dk, HEAD_DV=dv,
        BLOCK_DK=max(16, next_pow2(dk)), BLOCK_DV=max(16, next_pow2(dv)),
        BLOCK_Q=block_q, BLOCK_M=block_m_rows, BLOCK_N=max(16, bn),
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32", UPCAST=interpreting(),
        num_warps=nw, num_stages=ns,
    )
    return o
