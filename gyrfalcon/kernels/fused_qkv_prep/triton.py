"""The Triton qkv prep (one program per (token, head group)), and its jit helpers (RoPE tables, norm weights,
norm + RoPE of loaded heads) that decode attention's fused-prep kernel inlines too."""

from __future__ import annotations

from typing import Optional

import torch

from gyrfalcon.kernels.common import (HAS_TRITON, gdc_launch_dependents, gdc_wait, next_pow2, pdl_launch_kwargs, tl,
                                      triton, use_pdl)
from gyrfalcon.kernels.fused_qkv_prep.configs import heads_per_program


if HAS_TRITON:
    from gyrfalcon.kernels.rms_norm.triton import _row_rstd

    @triton.jit
    def _rope_tables(d, dmask, cs_row, ROT: tl.constexpr, IS_NEOX: tl.constexpr):
        """For dims d [BLOCK_D] of one position (cs_row: its cos | sin row): (partner, cos, sin, sign, rot),
        the dim each one rotates with (itself past ROT), its cos / sin, the sign of the partner's term and
        which dims rotate; rotate_half pairs (d, d + ROT/2) for neox, else interleaved (2i, 2i + 1)."""
        HALF: tl.constexpr = ROT // 2
        partner, cidx, sign, rot = _rope_pairs(d, ROT, IS_NEOX)
        cos = tl.load(cs_row + cidx, mask=rot & dmask, other=1.0)
        sin = tl.load(cs_row + HALF + cidx, mask=rot & dmask, other=0.0)
        return partner, cos, sin, sign, rot

    @triton.jit
    def _rope_pairs(d, ROT: tl.constexpr, IS_NEOX: tl.constexpr):
        """_rope_tables without its loads: (partner, the cos / sin column, sign, rot) of dims d."""
        HALF: tl.constexpr = ROT // 2
        if IS_NEOX:
            partner = tl.where(d < HALF, d + HALF, d - HALF)
            cidx = tl.where(d < HALF, d, d - HALF)
            sign = tl.where(d < HALF, -1.0, 1.0)
        else:
            partner = d ^ 1
            cidx = d // 2
            sign = tl.where((d % 2) == 0, -1.0, 1.0)
        rot = d < ROT
        partner = tl.where(rot, partner, d)
        return partner, cidx, sign, rot

    @triton.jit
    def _norm_weights(w_ptr, d, partner, dmask, HAS_W: tl.constexpr):
        """The per-head norm weight at dims d and at their RoPE partners, fp32 [BLOCK_D] each (ones without
        a weight). Constant across steps: callers under PDL load them before waiting on the previous kernel."""
        if HAS_W:
            wd = tl.load(w_ptr + d, mask=dmask, other=0.0).to(tl.float32)
            wp = tl.load(w_ptr + partner, mask=dmask, other=0.0).to(tl.float32)
        else:
            wd = tl.full(d.shape, 1.0, tl.float32)
            wp = wd
        return wd, wp

    @triton.jit
    def _norm_rope(row, offs, poffs, mask, wd, wp, cos, sin, sign, rot, scale, eps,
                   HAS_W: tl.constexpr, HEAD_D: tl.constexpr):
        """R heads of `row` -> [R, BLOCK_D] fp32: scaled by `scale` (the row's rstd with folded norms, else
        1.0), RMSNorm over each head (weights wd / wp from _norm_weights, if HAS_W), then RoPE. offs / poffs:
        [R, BLOCK_D] offsets of the heads' dims and of their partners; mask [R, BLOCK_D]; the rest from
        _rope_tables."""
        x = tl.load(row + offs, mask=mask, other=0.0)
        xp = tl.load(row + poffs, mask=mask, other=0.0)
        return _norm_rope_values(x, xp, wd, wp, cos, sin, sign, rot, scale, eps, HAS_W, HEAD_D)

    @triton.jit
    def _norm_rope_values(x, xp, wd, wp, cos, sin, sign, rot, scale, eps, HAS_W: tl.constexpr, HEAD_D: tl.constexpr):
        """_norm_rope on heads already loaded: x [R, BLOCK_D] and xp, the same heads at the partner dims (callers
        that load them themselves: decode attention's new K)."""
        x = x.to(tl.float32) * scale
        xp = xp.to(tl.float32) * scale
        if HAS_W:
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / HEAD_D + eps)
            x = x * rstd[:, None] * wd[None, :]
            xp = xp * rstd[:, None] * wp[None, :]
        return tl.where(rot[None, :], x * cos[None, :] + sign[None, :] * xp * sin[None, :], x)

    @triton.jit
    def _qkv_prep_kernel(
        qkv_ptr, q_out_ptr, pos_ptr, cs_ptr, slot_ptr, kc_ptr, vc_ptr, qw_ptr, kw_ptr,
        stride_qkv_t, stride_qo_t, stride_qo_h, stride_cs,
        stride_kc_blk, stride_kc_slot, stride_kc_head, stride_vc_blk, stride_vc_slot, stride_vc_head,
        eps, xs_ptr, stride_xs, eps_xs,
        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
        ROT: tl.constexpr, IS_NEOX: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        HAS_QW: tl.constexpr, HAS_KW: tl.constexpr, BLOCK_D: tl.constexpr, HEADS: tl.constexpr,
        USE_PDL: tl.constexpr, ROW_SCALE: tl.constexpr = False, HIDDEN: tl.constexpr = 1,
        BLOCK_H: tl.constexpr = 16, GROUP_MAJOR: tl.constexpr = False,
    ):
        """Program (token, group): HEADS q heads of the token (groups 0..cdiv(NUM_HEADS, HEADS)-1), or HEADS
        of its kv heads (the groups after), as one [HEADS, BLOCK_D] tile. ROW_SCALE: the qkv row is first
        scaled by rstd of the token's row of xs (HIDDEN wide): the input norm folded into the qkv GEMM.
        GROUP_MAJOR: the grid is (groups, tokens), so the programs of one token run side by side and its row
        of xs, which each of them reads, comes from L2 after the first."""
        if USE_PDL:
            gdc_launch_dependents()
        if GROUP_MAJOR:
            tok = tl.program_id(1)
            g = tl.program_id(0)
        else:
            tok = tl.program_id(0)
            g = tl.program_id(1)
        NQG: tl.constexpr = (NUM_HEADS + HEADS - 1) // HEADS
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_DIM
        # Positions (a step input), the RoPE table and the norm weights do not come from the previous
        # kernel: with PDL they load while it finishes. One RoPE row serves all HEADS heads.
        pos = tl.load(pos_ptr + tok).to(tl.int64)
        partner, cos, sin, sign, rot = _rope_tables(d, dmask, cs_ptr + pos * stride_cs, ROT, IS_NEOX)
        is_q = g < NQG
        if is_q:
            wd, wp = _norm_weights(qw_ptr, d, partner, dmask, HAS_QW)
        else:
            wd, wp = _norm_weights(kw_ptr, d, partner, dmask, HAS_KW)
        if USE_PDL:
            gdc_wait()  # qkv is the previous kernel's output
        scale = 1.0
        if ROW_SCALE:
            scale = _row_rstd(xs_ptr + tok.to(tl.int64) * stride_xs, eps_xs, HIDDEN, BLOCK_H)
        row = qkv_ptr + tok * stride_qkv_t
        # The group's heads: q heads h, or kv heads kvh (columns after the q heads: q | k | v).
        hr = tl.arange(0, HEADS)
        # (Each branch names its own mask: compiled Triton does not let a branch retype an outer variable.)
        if is_q:
            h = g * HEADS + hr
            mq = (h < NUM_HEADS)[:, None] & dmask[None, :]
            qcol = h * HEAD_DIM
            y = _norm_rope(row, qcol[:, None] + d[None, :], qcol[:, None] + partner[None, :], mq, wd, wp,
                           cos, sin, sign, rot, scale, eps, HAS_QW, HEAD_DIM)
            tl.store(q_out_ptr + tok * stride_qo_t + h[:, None] * stride_qo_h + d[None, :],
                     y.to(q_out_ptr.dtype.element_ty), mask=mq)
        else:
            slot = tl.load(slot_ptr + tok).to(tl.int64)
            if slot >= 0:
                kvh = (g - NQG) * HEADS + hr
                mk = (kvh < NUM_KV_HEADS)[:, None] & dmask[None, :]
                kcol = (NUM_HEADS + kvh) * HEAD_DIM
                yk = _norm_rope(row, kcol[:, None] + d[None, :], kcol[:, None] + partner[None, :], mk, wd, wp,
                                cos, sin, sign, rot, scale, eps, HAS_KW, HEAD_DIM)
                blk = slot // BLOCK_SIZE
                off = slot % BLOCK_SIZE
                tl.store(kc_ptr + blk * stride_kc_blk + off * stride_kc_slot + kvh[:, None] * stride_kc_head
                         + d[None, :], yk.to(kc_ptr.dtype.element_ty), mask=mk)
                v = tl.load(row + (kcol + NUM_KV_HEADS * HEAD_DIM)[:, None] + d[None, :], mask=mk, other=0.0)
                if ROW_SCALE:
                    v = v.to(tl.float32) * scale
                tl.store(vc_ptr + blk * stride_vc_blk + off * stride_vc_slot + kvh[:, None] * stride_vc_head
                         + d[None, :], v.to(vc_ptr.dtype.element_ty), mask=mk)


def qkv_prep_triton(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                    positions: torch.Tensor, cos_sin_cache: torch.Tensor, rotary_dim: int, is_neox: bool,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    q_norm_weight: Optional[torch.Tensor] = None, k_norm_weight: Optional[torch.Tensor] = None,
                    eps: float = 1e-6, row_scale=None, pdl: Optional[bool] = None,
                    heads: Optional[int] = None, group_major: Optional[bool] = None) -> torch.Tensor:
    """Same contract as qkv_prep_ref; one launch, no host sync (CUDA-graph safe). group_major: the grid as
    (groups, tokens) (default: with a row scale; see the kernel). pdl: launch with
    programmatic dependent launch (default: use_pdl(qkv)). heads: heads per program, a power of two
    (default: heads_per_program)."""
    assert qkv.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert cos_sin_cache.stride(-1) == 1
    T = qkv.shape[0]
    q_out = torch.empty(T, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return q_out
    dummy = qkv  # a valid pointer for the absent norm weights (never read)
    pdl = use_pdl(qkv) if pdl is None else pdl
    heads = heads_per_program(T, num_heads) if heads is None else heads
    groups = -(-num_heads // heads) + -(-num_kv_heads // heads)
    xs, eps_xs = row_scale if row_scale is not None else (qkv, 0.0)
    assert xs.stride(-1) == 1
    if group_major is None:  # with a row scale (a grid's second axis holds at most 65,535 programs)
        group_major = row_scale is not None and T <= 65535
    _qkv_prep_kernel[(groups, T) if group_major else (T, groups)](
        qkv, q_out, positions, cos_sin_cache, slot_mapping, k_cache, v_cache,
        q_norm_weight if q_norm_weight is not None else dummy,
        k_norm_weight if k_norm_weight is not None else dummy,
        qkv.stride(0), q_out.stride(0), q_out.stride(1), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        float(eps), xs, xs.stride(0), float(eps_xs),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, ROT=rotary_dim,
        IS_NEOX=bool(is_neox), BLOCK_SIZE=k_cache.shape[1],
        HAS_QW=q_norm_weight is not None, HAS_KW=k_norm_weight is not None,
        BLOCK_D=max(16, next_pow2(head_dim)), HEADS=heads, USE_PDL=pdl,
        ROW_SCALE=row_scale is not None, HIDDEN=xs.shape[-1] if row_scale is not None else 1,
        BLOCK_H=min(1024, max(16, next_pow2(xs.shape[-1]))) if row_scale is not None else 16,
        GROUP_MAJOR=group_major,
        num_warps=(1 if head_dim <= 128 else 2) if heads == 1 else 4,
        **pdl_launch_kwargs(pdl),
    )
    return q_out
