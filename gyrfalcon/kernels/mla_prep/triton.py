"""The Triton MLA prep kernels: the kv prep (one launch: latent RMSNorm + k_rope RoPE + the latent cache write, the
q_a RMSNorm, the V3.2 indexer key's LayerNorm + RoPE + its cache write), the q prep (one launch: the absorbed
query q_nope @ W_UK per head as a tiled dot, q_rope's RoPE beside it, the V3.2 index query's RoPE and weight scale)
and the V projection (one launch: o_latent @ W_UV^T per head, written as o_proj's [T, H * v] input). In batch-1
decode graphs they launch with programmatic dependent launch (common.use_pdl), waiting for the previous kernel
before any load.
Contracts: naive.py's mla_kv_prep_ref / mla_q_prep_ref / mla_v_proj_ref."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from gyrfalcon.kernels.common import (HAS_TRITON, cdiv, gdc_launch_dependents, gdc_wait, interpreting, next_pow2,
                                      pdl_launch_kwargs, tl, triton, use_pdl)
from gyrfalcon.kernels.mla_prep.naive import IndexKeyPrep, IndexQueryPrep

if HAS_TRITON:
    from gyrfalcon.kernels.fused_qkv_prep.triton import _rope_pairs, _rope_tables

    @triton.jit
    def _mla_kv_prep_kernel(
        kv_ptr, pos_ptr, cs_ptr, slot_ptr, c_ptr, kvw_ptr, qa_ptr, qw_ptr, qo_ptr, ik_ptr, iw_ptr, ib_ptr, ic_ptr,
        s_kv, s_cs, s_cb, s_co, s_qa, s_qo, s_ik, s_icb, s_ico, eps, i_eps,
        L: tl.constexpr, R: tl.constexpr, Q: tl.constexpr, D: tl.constexpr, IS_NEOX: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, I_BLOCK_SIZE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, Q_PART: tl.constexpr, IDX_PART: tl.constexpr,
        USE_PDL: tl.constexpr = False,
    ):
        """Program (token, part): part 0 the latent row, Q_PART the q_a row, IDX_PART the indexer key (-1: absent).
        Every row is read once and normalized in fp32; RoPE partners are loaded again at their offsets (and
        normalized with the same statistics) rather than shuffled in registers. USE_PDL (batch-1 decode graphs):
        the next kernel may launch at once; every program waits for the previous one before any load."""
        if USE_PDL:
            gdc_launch_dependents()
            gdc_wait()
        tok = tl.program_id(0)
        part = tl.program_id(1)
        tok64 = tok.to(tl.int64)
        if part == 0:
            slot = tl.load(slot_ptr + tok).to(tl.int64)
            if slot >= 0:
                row = kv_ptr + tok64 * s_kv
                dst = c_ptr + (slot // BLOCK_SIZE) * s_cb + (slot % BLOCK_SIZE) * s_co
                dl = tl.arange(0, BLOCK_L)
                ml = dl < L
                x = tl.load(row + dl, mask=ml, other=0.0).to(tl.float32)
                rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / L + eps)
                w = tl.load(kvw_ptr + dl, mask=ml, other=0.0).to(tl.float32)
                tl.store(dst + dl, (x * rstd * w).to(c_ptr.dtype.element_ty), mask=ml)
                pos = tl.load(pos_ptr + tok).to(tl.int64)
                dr = tl.arange(0, BLOCK_R)
                mr = dr < R
                partner, cos, sin, sign, rot = _rope_tables(dr, mr, cs_ptr + pos * s_cs, R, IS_NEOX)
                xr = tl.load(row + L + dr, mask=mr, other=0.0).to(tl.float32)
                xp = tl.load(row + L + partner, mask=mr, other=0.0).to(tl.float32)
                tl.store(dst + L + dr, (xr * cos + sign * xp * sin).to(c_ptr.dtype.element_ty), mask=mr)
        elif part == Q_PART:
            dq = tl.arange(0, BLOCK_Q)
            mq = dq < Q
            x = tl.load(qa_ptr + tok64 * s_qa + dq, mask=mq, other=0.0).to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / Q + eps)
            w = tl.load(qw_ptr + dq, mask=mq, other=0.0).to(tl.float32)
            tl.store(qo_ptr + tok64 * s_qo + dq, (x * rstd * w).to(qo_ptr.dtype.element_ty), mask=mq)
        elif part == IDX_PART:
            slot = tl.load(slot_ptr + tok).to(tl.int64)
            if slot >= 0:
                row = ik_ptr + tok64 * s_ik
                d = tl.arange(0, BLOCK_D)
                md = d < D
                pos = tl.load(pos_ptr + tok).to(tl.int64)
                # The indexer's RoPE is rotate_half on the first R dims, whatever MLA's own style.
                partner, cos, sin, sign, rot = _rope_tables(d, md, cs_ptr + pos * s_cs, R, True)
                x = tl.load(row + d, mask=md, other=0.0).to(tl.float32)
                mean = tl.sum(x, axis=0) / D
                xc = tl.where(md, x - mean, 0.0)
                rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / D + i_eps)
                y = xc * rstd * tl.load(iw_ptr + d, mask=md, other=0.0).to(tl.float32) \
                    + tl.load(ib_ptr + d, mask=md, other=0.0).to(tl.float32)
                xp = tl.load(row + partner, mask=md, other=0.0).to(tl.float32)
                yp = (xp - mean) * rstd * tl.load(iw_ptr + partner, mask=md, other=0.0).to(tl.float32) \
                    + tl.load(ib_ptr + partner, mask=md, other=0.0).to(tl.float32)
                y = tl.where(rot, y * cos + sign * yp * sin, y)
                dst = ic_ptr + (slot // I_BLOCK_SIZE) * s_icb + (slot % I_BLOCK_SIZE) * s_ico
                tl.store(dst + d, y.to(ic_ptr.dtype.element_ty), mask=md)

    @triton.jit
    def _head_dot(a_rows, tm, w_head, s_wk, s_wn, n, nm, K: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
        """One head's [BLOCK_T, BLOCK_N] tile of a[t, :K] @ W[:K, n] in fp32: a_rows [BLOCK_T, 1] pointers to the
        tokens' rows (tm: the valid ones), W at w_head with strides s_wk (K) and s_wn (N), columns n (nm valid)."""
        acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            km = k < K
            a = tl.load(a_rows + k[None, :], mask=tm[:, None] & km[None, :], other=0.0)
            b = tl.load(w_head + k[:, None] * s_wk + n[None, :] * s_wn, mask=km[:, None] & nm[None, :], other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc += tl.dot(a, b.to(a.dtype), input_precision=DOT_PREC)
        return acc

    # The token count and the grid's shape change with every batch: not specialized (1 / a multiple of 16 / the rest
    # would each compile a variant mid-run; the token block, a constexpr, takes two values by design).
    @triton.jit(do_not_specialize=["T", "n_tb", "n_main"])
    def _mla_q_prep_kernel(
        q_ptr, wuk_ptr, pos_ptr, cs_ptr, o_ptr, iq_ptr, iw_ptr, iqo_ptr, iwo_ptr, w_scale, T, n_tb, n_main,
        s_qt, s_qh, s_wh, s_wk, s_ot, s_oh, s_cs, s_iqt, s_iqh, s_iwt, s_iqot, s_iqoh, s_iwot,
        H: tl.constexpr, NOPE: tl.constexpr, L: tl.constexpr, R: tl.constexpr, IS_NEOX: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
        HI: tl.constexpr, D: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_D: tl.constexpr,
        DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr = False,
    ):
        """Programs [0, n_main): tile (head h, token block, latent block) of q_abs = q_nope @ W_UK[h] (W_UK[h] [NOPE,
        L] read once per token block, the head slowest so its tiles share L2); the latent block 0 programs also
        rotate the block's q_rope into q_abs[..., L:]. Programs past n_main: one token's index query (all HI heads)
        and index weights. USE_PDL: as in the kv prep."""
        if USE_PDL:
            gdc_launch_dependents()
            gdc_wait()
        pid = tl.program_id(0)
        if pid < n_main:
            n_lb: tl.constexpr = (L + BLOCK_L - 1) // BLOCK_L
            lb = pid % n_lb
            rest = pid // n_lb
            tb = rest % n_tb
            h = rest // n_tb
            t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
            tm = t < T
            t64 = t.to(tl.int64)
            l = lb * BLOCK_L + tl.arange(0, BLOCK_L)
            lm = l < L
            q_rows = q_ptr + t64[:, None] * s_qt + h * s_qh
            acc = _head_dot(q_rows, tm, wuk_ptr + h * s_wh, s_wk, 1, l, lm, NOPE, BLOCK_T, BLOCK_L, BLOCK_K,
                            DOT_PREC, UPCAST)
            o_rows = o_ptr + t64[:, None] * s_ot + h * s_oh
            tl.store(o_rows + l[None, :], acc.to(o_ptr.dtype.element_ty), mask=tm[:, None] & lm[None, :])
            if lb == 0:
                dr = tl.arange(0, BLOCK_R)
                m2 = tm[:, None] & (dr < R)[None, :]
                partner, cidx, sign, rot = _rope_pairs(dr, R, IS_NEOX)
                pos = tl.load(pos_ptr + t, mask=tm, other=0).to(tl.int64)
                cs_rows = cs_ptr + pos[:, None] * s_cs
                cos = tl.load(cs_rows + cidx[None, :], mask=m2, other=1.0)
                sin = tl.load(cs_rows + R // 2 + cidx[None, :], mask=m2, other=0.0)
                x = tl.load(q_rows + NOPE + dr[None, :], mask=m2, other=0.0).to(tl.float32)
                xp = tl.load(q_rows + NOPE + partner[None, :], mask=m2, other=0.0).to(tl.float32)
                y = x * cos + sign[None, :] * xp * sin
                tl.store(o_rows + L + dr[None, :], y.to(o_ptr.dtype.element_ty), mask=m2)
        else:
            tok = (pid - n_main).to(tl.int64)
            hi = tl.arange(0, BLOCK_HI)
            d = tl.arange(0, BLOCK_D)
            md = d < D
            mh = hi < HI
            m2 = mh[:, None] & md[None, :]
            pos = tl.load(pos_ptr + tok).to(tl.int64)
            partner, cos, sin, sign, rot = _rope_tables(d, md, cs_ptr + pos * s_cs, R, True)
            rows = iq_ptr + tok * s_iqt + hi[:, None] * s_iqh
            x = tl.load(rows + d[None, :], mask=m2, other=0.0).to(tl.float32)
            xp = tl.load(rows + partner[None, :], mask=m2, other=0.0).to(tl.float32)
            y = tl.where(rot[None, :], x * cos[None, :] + sign[None, :] * xp * sin[None, :], x)
            tl.store(iqo_ptr + tok * s_iqot + hi[:, None] * s_iqoh + d[None, :], y.to(iqo_ptr.dtype.element_ty),
                     mask=m2)
            w = tl.load(iw_ptr + tok * s_iwt + hi, mask=mh, other=0.0).to(tl.float32)
            tl.store(iwo_ptr + tok * s_iwot + hi, w * w_scale, mask=mh)


    @triton.jit(do_not_specialize=["T", "n_tb"])  # as _mla_q_prep_kernel
    def _mla_v_proj_kernel(o_ptr, w_ptr, out_ptr, T, n_tb, s_ot, s_oh, s_wh, s_wv, s_yt,
                           L: tl.constexpr, V: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
                           BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
                           USE_PDL: tl.constexpr = False):
        """Program: tile (head h, token block, v block) of out[t, h * V + v] = o[t, h, :] @ W_UV[h, v, :]^T (the head
        slowest, so W_UV[h]'s tiles share L2). USE_PDL: as in the kv prep."""
        if USE_PDL:
            gdc_launch_dependents()
            gdc_wait()
        pid = tl.program_id(0)
        n_vb: tl.constexpr = (V + BLOCK_V - 1) // BLOCK_V
        vb = pid % n_vb
        rest = pid // n_vb
        tb = rest % n_tb
        h = rest // n_tb
        t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
        tm = t < T
        t64 = t.to(tl.int64)
        v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        vm = v < V
        acc = _head_dot(o_ptr + t64[:, None] * s_ot + h * s_oh, tm, w_ptr + h * s_wh, 1, s_wv, v, vm, L, BLOCK_T,
                        BLOCK_V, BLOCK_K, DOT_PREC, UPCAST)
        tl.store(out_ptr + t64[:, None] * s_yt + h * V + v[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=tm[:, None] & vm[None, :])


def mla_kv_prep_triton(kv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, rope_dim: int,
                       is_neox: bool, kv_norm_weight: torch.Tensor, eps: float, cache: torch.Tensor,
                       slot_mapping: torch.Tensor, q_a: Optional[torch.Tensor] = None,
                       q_norm_weight: Optional[torch.Tensor] = None,
                       index: Optional[IndexKeyPrep] = None, pdl: Optional[bool] = None) -> Optional[torch.Tensor]:
    """Same contract as mla_kv_prep_ref; one launch of T x (1 + [q_a] + [index]) programs, no host sync. pdl: launch
    with programmatic dependent launch (default: use_pdl(kv))."""
    assert kv.stride(-1) == 1 and cache.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    T = kv.shape[0]
    L = kv.shape[-1] - rope_dim
    q_out = torch.empty_like(q_a, memory_format=torch.contiguous_format) if q_a is not None else None
    if T == 0:
        return q_out
    parts = 1
    q_part = idx_part = -1
    if q_a is not None:
        assert q_a.stride(-1) == 1
        q_part, parts = parts, parts + 1
    if index is not None:
        assert index.k.stride(-1) == 1 and index.cache.stride(-1) == 1
        idx_part, parts = parts, parts + 1
    qa = q_a if q_a is not None else kv  # valid pointers for the absent parts (never read)
    qo = q_out if q_out is not None else kv
    ik, icache = (index.k, index.cache) if index is not None else (kv, cache)
    Q = q_a.shape[-1] if q_a is not None else 1
    D = index.k.shape[-1] if index is not None else 1
    pdl = use_pdl(kv) if pdl is None else pdl
    _mla_kv_prep_kernel[(T, parts)](
        kv, positions, cos_sin_cache, slot_mapping, cache, kv_norm_weight, qa,
        q_norm_weight if q_a is not None else kv_norm_weight, qo, ik,
        index.weight if index is not None else kv_norm_weight, index.bias if index is not None else kv_norm_weight,
        icache, kv.stride(0), cos_sin_cache.stride(0), cache.stride(0), cache.stride(1), qa.stride(0), qo.stride(0),
        ik.stride(0), icache.stride(0), icache.stride(1), float(eps), float(index.eps if index is not None else 0.0),
        L=L, R=rope_dim, Q=Q, D=D, IS_NEOX=bool(is_neox), BLOCK_SIZE=cache.shape[1], I_BLOCK_SIZE=icache.shape[1],
        BLOCK_L=max(16, next_pow2(L)), BLOCK_R=max(16, next_pow2(rope_dim)), BLOCK_Q=max(16, next_pow2(Q)),
        BLOCK_D=max(16, next_pow2(D)), Q_PART=q_part, IDX_PART=idx_part, USE_PDL=pdl, num_warps=4,
        **pdl_launch_kwargs(pdl),
    )
    return q_out


def _q_tiles(T: int, N: int, K: int) -> Tuple[int, int, int]:
    """(BLOCK_T, BLOCK_N, BLOCK_K) of a per-head dot [T, K] @ [K, N] (the absorbed query, the V projection;
    untuned): decode-sized steps take the smallest token block tl.dot allows; the head's weight is read once per
    token block, so prefill takes larger ones."""
    block_t = 16 if T <= 16 else 64
    return block_t, min(128, max(16, next_pow2(N))), min(64, max(16, next_pow2(K)))


def mla_q_prep_triton(q: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, rope_dim: int,
                      is_neox: bool, w_uk: torch.Tensor, index: Optional[IndexQueryPrep] = None,
                      pdl: Optional[bool] = None) -> Tuple[torch.Tensor, Optional[Tuple[torch.Tensor, torch.Tensor]]]:
    """Same contract as mla_q_prep_ref; one launch, no host sync. pdl: as in mla_kv_prep_triton."""
    assert q.stride(-1) == 1 and w_uk.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    T, H, _ = q.shape
    nope = q.shape[-1] - rope_dim
    L = w_uk.shape[-1]
    assert w_uk.shape == (H, nope, L) and w_uk.dtype == q.dtype
    q_abs = torch.empty(T, H, L + rope_dim, dtype=q.dtype, device=q.device)
    iout = None
    if index is not None:
        assert index.q.stride(-1) == 1
        iout = (torch.empty_like(index.q, memory_format=torch.contiguous_format),
                torch.empty(index.w.shape, dtype=torch.float32, device=q.device))
    if T == 0:
        return q_abs, iout
    block_t, block_l, block_k = _q_tiles(T, L, nope)
    n_tb = cdiv(T, block_t)
    n_main = H * n_tb * cdiv(L, block_l)
    iq, iw = (index.q, index.w) if index is not None else (q, q[:, :, 0])
    iqo, iwo = iout if iout is not None else (q_abs, q_abs[:, :, 0])
    HI, D = (index.q.shape[1], index.q.shape[2]) if index is not None else (1, 1)
    pdl = use_pdl(q) if pdl is None else pdl
    _mla_q_prep_kernel[(n_main + (T if index is not None else 0),)](
        q, w_uk, positions, cos_sin_cache, q_abs, iq, iw, iqo, iwo,
        float(index.w_scale) if index is not None else 1.0, T, n_tb, n_main,
        q.stride(0), q.stride(1), w_uk.stride(0), w_uk.stride(1), q_abs.stride(0), q_abs.stride(1),
        cos_sin_cache.stride(0), iq.stride(0), iq.stride(1), iw.stride(0), iqo.stride(0), iqo.stride(1),
        iwo.stride(0),
        H=H, NOPE=nope, L=L, R=rope_dim, IS_NEOX=bool(is_neox), BLOCK_T=block_t, BLOCK_L=block_l, BLOCK_K=block_k,
        BLOCK_R=max(16, next_pow2(rope_dim)), HI=HI, D=D, BLOCK_HI=max(2, next_pow2(HI)),
        BLOCK_D=max(16, next_pow2(D)), DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=interpreting(), USE_PDL=pdl, num_warps=4, **pdl_launch_kwargs(pdl),
    )
    return q_abs, iout


def mla_v_proj_triton(o_latent: torch.Tensor, w_uv: torch.Tensor, pdl: Optional[bool] = None) -> torch.Tensor:
    """Same contract as mla_v_proj_ref; one launch straight into o_proj's input layout, no host sync. pdl: as in
    mla_kv_prep_triton."""
    assert o_latent.stride(-1) == 1 and w_uv.stride(-1) == 1 and w_uv.dtype == o_latent.dtype
    T, H, L = o_latent.shape
    V = w_uv.shape[1]
    assert w_uv.shape == (H, V, L)
    out = torch.empty(T, H * V, dtype=o_latent.dtype, device=o_latent.device)
    if T == 0:
        return out
    block_t, block_v, block_k = _q_tiles(T, V, L)
    n_tb = cdiv(T, block_t)
    pdl = use_pdl(o_latent) if pdl is None else pdl
    _mla_v_proj_kernel[(H * n_tb * cdiv(V, block_v),)](
        o_latent, w_uv, out, T, n_tb, o_latent.stride(0), o_latent.stride(1), w_uv.stride(0), w_uv.stride(1),
        out.stride(0), L=L, V=V, BLOCK_T=block_t, BLOCK_V=block_v, BLOCK_K=block_k,
        DOT_PREC="ieee" if o_latent.dtype == torch.float32 else "tf32", UPCAST=interpreting(), USE_PDL=pdl,
        num_warps=4, **pdl_launch_kwargs(pdl),
    )
    return out
