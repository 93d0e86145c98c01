"""Triton varlen causal attention for MLA prefill in the expanded form (per-head keys and values from kv_b_proj).

Why a second form: the absorbed form (triton.py) attends every head over the 576-wide [latent | k_rope] rows and
accumulates 512-wide latent outputs. The expanded form first rebuilds per-head K_nope and V from the latent rows
(kv_b_proj), then scores over 128 + 64 = 192 dims and accumulates 128-wide values. FLOPs at the real dims (H = 128
heads, L = 512, nope = 128, R = 64, v = 128) for one 8192-token prompt, P = 8192 * 8193 / 2 = 33.6M causal
(query, key) pairs:
    absorbed: P * 2H(L + R + L) = P * 278,528 = 9.35 TFLOP, + the absorbed query q_nope W_UK and W_UV after
              attention, 8192 * 2H * L * (nope + v) = 0.27 TFLOP
    expanded: P * 2H(nope + R + v) = P * 81,920 = 2.75 TFLOP, + kv_b_proj over the 8192 context rows
              8192 * 2 * L * H(nope + v) = 0.27 TFLOP
~9.6 vs ~3.0 TFLOP a layer: 3.2x fewer.
The expansion costs 2 * L * H(nope + v) = 33.5 MFLOP per context row against 196,608 FLOP saved per pair, so it
pays once a sequence runs more than ~170 query tokens over its context (layers/mla.py picks the form per step by
this arithmetic); decode and verify rows keep the absorbed form.

Inputs (contiguous, not paged: the caller gathers and expands the context rows):
    q_nope [T, H, Dn], q_rope [T, H, R] (roped): the step's queries, any head / token strides;
    k_nope [N, H, Dn], v [N, H, Dv]: the expanded context rows (views of kv_b_proj's output, any strides);
    k_rope [N, R]: the roped rope part, one head shared by every head (never broadcast in memory);
    cu_q int32 [B + 1]: sequence b's queries are rows cu_q[b] .. cu_q[b + 1] - 1;
    meta int32 [B, 3] = (k_start, k_len, delta): its keys are rows k_start .. k_start + k_len - 1, and query i
        (0-based within the sequence) sees key j (0-based within its k_len) iff j <= i + delta (delta = the first
        query's position minus the first key's position: causality on positions, for a prefix chunk too).
Output o [T, H, Dv] and lse [T, H] fp32 (log2 units; -inf where a query saw no key of this call, its o zeros), so
calls over successive chunks of a long context merge exactly (merge_partials).
"""

from __future__ import annotations

import torch

from gyrfalcon.kernels.common import HAS_TRITON, interpreting, next_pow2, tl, triton

if HAS_TRITON:
    from gyrfalcon.kernels.paged_attention.triton import _find_seq

_LOG2E = 1.4426950408889634

if HAS_TRITON:

    @triton.jit
    def _expanded_step(
        acc, m_i, l_i, qn, qr, qi, kn_ptr, kr_ptr, v_ptr, start, k_start, k_end, delta, h, scale_log2,
        s_knt, s_knh, s_krt, s_vt, s_vh,
        DN: tl.constexpr, R: tl.constexpr, DV: tl.constexpr, BLOCK_DN: tl.constexpr, BLOCK_R: tl.constexpr,
        BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
        MASKED: tl.constexpr,
    ):
        # One BLOCK_N-key step of online softmax for a BLOCK_M x one-head query tile. MASKED=False: a tile every row
        # sees whole (below the causal bound of the tile's first query, inside k_len): no masks on loads or scores.
        kj = start + tl.arange(0, BLOCK_N)
        dn = tl.arange(0, BLOCK_DN)
        dr = tl.arange(0, BLOCK_R)
        dv = tl.arange(0, BLOCK_DV)
        krow = (k_start + kj).to(tl.int64)
        if MASKED:
            kmask = kj < k_end
            kn = tl.load(kn_ptr + krow[:, None] * s_knt + h * s_knh + dn[None, :],
                         mask=kmask[:, None] & (dn[None, :] < DN), other=0.0)
            kr = tl.load(kr_ptr + krow[:, None] * s_krt + dr[None, :], mask=kmask[:, None] & (dr[None, :] < R),
                         other=0.0)
            vv = tl.load(v_ptr + krow[:, None] * s_vt + h * s_vh + dv[None, :],
                         mask=kmask[:, None] & (dv[None, :] < DV), other=0.0)
        elif (DN == BLOCK_DN) & (R == BLOCK_R) & (DV == BLOCK_DV):  # the real dims (128, 64, 128): no mask at all
            kn = tl.load(kn_ptr + krow[:, None] * s_knt + h * s_knh + dn[None, :])
            kr = tl.load(kr_ptr + krow[:, None] * s_krt + dr[None, :])
            vv = tl.load(v_ptr + krow[:, None] * s_vt + h * s_vh + dv[None, :])
        else:
            kn = tl.load(kn_ptr + krow[:, None] * s_knt + h * s_knh + dn[None, :], mask=dn[None, :] < DN, other=0.0)
            kr = tl.load(kr_ptr + krow[:, None] * s_krt + dr[None, :], mask=dr[None, :] < R, other=0.0)
            vv = tl.load(v_ptr + krow[:, None] * s_vt + h * s_vh + dv[None, :], mask=dv[None, :] < DV, other=0.0)
        if UPCAST:
            kn = kn.to(tl.float32)
            kr = kr.to(tl.float32)
            vv = vv.to(tl.float32)
        else:
            kn = kn.to(qn.dtype)
            kr = kr.to(qn.dtype)
            vv = vv.to(qn.dtype)
        s = tl.dot(qn, tl.trans(kn), input_precision=DOT_PREC)
        s += tl.dot(qr, tl.trans(kr), input_precision=DOT_PREC)
        if MASKED:
            visible = (kj[None, :] < k_end) & (kj[None, :] <= qi[:, None] + delta)
            s = tl.where(visible, s * scale_log2, float("-inf"))
        else:
            s = s * scale_log2
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet: p = 0, not NaN
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv, input_precision=DOT_PREC)
        return acc, m_new, l_i

    # The sequence count changes from step to step: not specialized (paged_attention's prefill kernel does the same).
    @triton.jit(do_not_specialize=["num_seqs"])
    def _mla_prefill_expanded_kernel(
        qn_ptr, qr_ptr, kn_ptr, kr_ptr, v_ptr, cuq_ptr, meta_ptr, o_ptr, lse_ptr, scale_log2, num_seqs,
        s_qnt, s_qnh, s_qrt, s_qrh, s_knt, s_knh, s_krt, s_vt, s_vh, s_ot, s_oh, s_lt,
        DN: tl.constexpr, R: tl.constexpr, DV: tl.constexpr, BLOCK_DN: tl.constexpr, BLOCK_R: tl.constexpr,
        BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        """Grid (num_tokens // BLOCK_M + num_seqs, H): a program owns BLOCK_M query tokens of one sequence for one
        head and streams that head's [BLOCK_N, Dn] K_nope / [BLOCK_N, Dv] V tiles and the shared [BLOCK_N, R]
        k_rope tile, keys up to its last query's causal bound. Query blocks run in reverse, longest contexts
        first."""
        q_block = tl.num_programs(0) - 1 - tl.program_id(0)
        h = tl.program_id(1)
        seq = _find_seq(cuq_ptr, num_seqs, q_block, BLOCK_M)
        q_start = tl.load(cuq_ptr + seq)
        q_len = tl.load(cuq_ptr + seq + 1) - q_start
        local = q_block - (q_start // BLOCK_M + seq)
        if local * BLOCK_M >= q_len:
            return
        k_start = tl.load(meta_ptr + seq * 3)
        k_len = tl.load(meta_ptr + seq * 3 + 1)
        delta = tl.load(meta_ptr + seq * 3 + 2)
        qi = local * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = qi < q_len
        tok = (q_start + qi).to(tl.int64)
        dn = tl.arange(0, BLOCK_DN)
        dr = tl.arange(0, BLOCK_R)
        dv = tl.arange(0, BLOCK_DV)
        qn = tl.load(qn_ptr + tok[:, None] * s_qnt + h * s_qnh + dn[None, :],
                     mask=row_ok[:, None] & (dn[None, :] < DN), other=0.0)
        qr = tl.load(qr_ptr + tok[:, None] * s_qrt + h * s_qrh + dr[None, :],
                     mask=row_ok[:, None] & (dr[None, :] < R), other=0.0)
        if UPCAST:
            qn = qn.to(tl.float32)
            qr = qr.to(tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        # Keys past the tile's last query's bound are invisible to every row of it; keys up to its first query's
        # bound are visible to every row, so whole BLOCK_N tiles below that run without masks.
        k_end = tl.minimum(k_len, tl.maximum(local * BLOCK_M + BLOCK_M - 1 + delta + 1, 0))
        full_end = tl.minimum(k_len, tl.maximum(local * BLOCK_M + delta + 1, 0)) // BLOCK_N * BLOCK_N
        for start in range(0, full_end, BLOCK_N):
            acc, m_i, l_i = _expanded_step(
                acc, m_i, l_i, qn, qr, qi, kn_ptr, kr_ptr, v_ptr, start, k_start, k_end, delta, h, scale_log2,
                s_knt, s_knh, s_krt, s_vt, s_vh, DN, R, DV, BLOCK_DN, BLOCK_R, BLOCK_DV, BLOCK_N, DOT_PREC, UPCAST,
                False)
        for start in range(full_end, k_end, BLOCK_N):
            acc, m_i, l_i = _expanded_step(
                acc, m_i, l_i, qn, qr, qi, kn_ptr, kr_ptr, v_ptr, start, k_start, k_end, delta, h, scale_log2,
                s_knt, s_knh, s_krt, s_vt, s_vh, DN, R, DV, BLOCK_DN, BLOCK_R, BLOCK_DV, BLOCK_N, DOT_PREC, UPCAST,
                True)
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        tl.store(o_ptr + tok[:, None] * s_ot + h * s_oh + dv[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (dv[None, :] < DV))
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
        tl.store(lse_ptr + tok * s_lt + h, lse, mask=row_ok)


def _expanded_tiles(head_dim: int):
    """(BLOCK_M query tokens, BLOCK_N keys, num_warps) a program (untuned): at Dn + R = 192 and Dv = 128 a 64 x 192
    query tile, 64 x 192 key and 64 x 128 value tiles and a 64 x 128 fp32 accumulator: 104 KB of shared memory with
    two stages on sm_90 (scripts/compile_check.py)."""
    if head_dim > 128:
        return 64, 64, 8
    return 64, 32, 4


def mla_prefill_expanded_triton(q_nope: torch.Tensor, q_rope: torch.Tensor, k_nope: torch.Tensor,
                                k_rope: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, meta: torch.Tensor,
                                scale: float, out_dtype: torch.dtype | None = None, *, block_m: int | None = None,
                                block_n: int | None = None):
    """The expanded MLA prefill (module docstring) -> (o [T, H, Dv] in out_dtype (default q's), lse [T, H] fp32,
    log2 units). The grid is sized from shapes (num_tokens // BLOCK_M + num_seqs); rows past cu_q[-1] are left
    zero / -inf. block_m / block_n override the tiles (tests)."""
    assert q_nope.stride(-1) == 1 and q_rope.stride(-1) == 1 and k_nope.stride(-1) == 1
    assert k_rope.stride(-1) == 1 and v.stride(-1) == 1 and meta.is_contiguous()
    T, H, DN = q_nope.shape
    R, DV = q_rope.shape[-1], v.shape[-1]
    B = meta.shape[0]
    o = torch.zeros(T, H, DV, dtype=out_dtype or q_nope.dtype, device=q_nope.device)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=q_nope.device)
    if T == 0 or B == 0:
        return o, lse
    bm, bn, nw = _expanded_tiles(DN + R)
    bm, bn = max(16, block_m or bm), max(16, block_n or bn)
    _mla_prefill_expanded_kernel[(T // bm + B, H)](
        q_nope, q_rope, k_nope, k_rope, v, cu_q, meta, o, lse, float(scale) * _LOG2E, B,
        q_nope.stride(0), q_nope.stride(1), q_rope.stride(0), q_rope.stride(1), k_nope.stride(0), k_nope.stride(1),
        k_rope.stride(0), v.stride(0), v.stride(1), o.stride(0), o.stride(1), lse.stride(0),
        DN=DN, R=R, DV=DV, BLOCK_DN=max(16, next_pow2(DN)), BLOCK_R=max(16, next_pow2(R)),
        BLOCK_DV=max(16, next_pow2(DV)), BLOCK_M=bm, BLOCK_N=bn,
        DOT_PREC="ieee" if q_nope.dtype == torch.float32 else "tf32", UPCAST=interpreting(), num_warps=nw,
        num_stages=2,
    )
    return o, lse
