"""Triton KV-cache write: one program per (token, head block)."""

from __future__ import annotations

import torch

from gyrfalcon.kernels.common import HAS_TRITON, next_pow2, tl, triton


if HAS_TRITON:

    @triton.jit
    def _store_kv_kernel(
        k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
        n_heads, block_size,
        s_kt, s_kh, s_vt, s_vh,
        s_kcb, s_kco, s_kch, s_vcb, s_vco, s_vch,
        HEAD_DIM_K: tl.constexpr, HEAD_DIM_V: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    ):
        # Grid: (num_tokens, head blocks). Masked stores instead of an early return keep the
        # kernel branch-free; a skipped slot (< 0) costs one scalar load.
        tok = tl.program_id(0)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        slot = tl.load(slot_ptr + tok)
        # A skipped slot masks every head (folding the scalar test into the bound keeps the mask a
        # plain block-shaped comparison).
        n_valid = tl.where(slot >= 0, n_heads, 0)
        slot = tl.maximum(slot, 0)
        blk = slot // block_size
        off = slot % block_size
        hmask = heads < n_valid
        dk = tl.arange(0, BLOCK_DK)
        mk = hmask[:, None] & (dk[None, :] < HEAD_DIM_K)
        kx = tl.load(k_ptr + tok * s_kt + heads[:, None] * s_kh + dk[None, :], mask=mk)
        tl.store(kc_ptr + blk * s_kcb + off * s_kco + heads[:, None] * s_kch + dk[None, :],
                 kx.to(kc_ptr.dtype.element_ty), mask=mk)
        dv = tl.arange(0, BLOCK_DV)
        mv = hmask[:, None] & (dv[None, :] < HEAD_DIM_V)
        vx = tl.load(v_ptr + tok * s_vt + heads[:, None] * s_vh + dv[None, :], mask=mv)
        tl.store(vc_ptr + blk * s_vcb + off * s_vco + heads[:, None] * s_vch + dv[None, :],
                 vx.to(vc_ptr.dtype.element_ty), mask=mv)


def store_kv_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton cache write; same contract as store_kv_ref. No host syncs (CUDA-graph safe)."""
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    num_tokens, n_heads, dk = k.shape
    dv = v.shape[-1]
    if num_tokens == 0:
        return
    BLOCK_DK, BLOCK_DV = next_pow2(dk), next_pow2(dv)
    BLOCK_H = max(1, min(next_pow2(n_heads), max(1, 4096 // max(BLOCK_DK, BLOCK_DV))))
    grid = (num_tokens, triton.cdiv(n_heads, BLOCK_H))
    _store_kv_kernel[grid](
        k, v, k_cache, v_cache, slot_mapping,
        n_heads, k_cache.shape[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HEAD_DIM_K=dk, HEAD_DIM_V=dv, BLOCK_H=BLOCK_H, BLOCK_DK=BLOCK_DK, BLOCK_DV=BLOCK_DV,
        num_warps=4,
    )
