"""Triton RoPE over q and k in one launch, in place."""

from __future__ import annotations

import torch

from gyrfalcon.kernels.common import HAS_TRITON, next_pow2, tl, triton


if HAS_TRITON:

    @triton.jit
    def _rotate_tile(x_ptr, tok, head0, n_heads, stride_t, stride_h, cos, sin,
                     HALF: tl.constexpr, IS_NEOX: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
        heads = head0 + tl.arange(0, BLOCK_H)
        cols = tl.arange(0, BLOCK_HALF)
        mask = (heads[:, None] < n_heads) & (cols[None, :] < HALF)
        base = x_ptr + tok * stride_t + heads[:, None] * stride_h
        if IS_NEOX:
            off1 = cols[None, :]
            off2 = cols[None, :] + HALF
        else:
            off1 = 2 * cols[None, :]
            off2 = 2 * cols[None, :] + 1
        x1 = tl.load(base + off1, mask=mask, other=0.0)
        x2 = tl.load(base + off2, mask=mask, other=0.0)
        x1f = x1.to(tl.float32)
        x2f = x2.to(tl.float32)
        o1 = x1f * cos[None, :] - x2f * sin[None, :]
        o2 = x2f * cos[None, :] + x1f * sin[None, :]
        tl.store(base + off1, o1.to(x1.dtype), mask=mask)
        tl.store(base + off2, o2.to(x1.dtype), mask=mask)

    @triton.jit
    def _rotary_kernel(
        q_ptr, k_ptr, pos_ptr, cs_ptr,
        n_q_heads, n_k_heads, stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
        n_q_blocks,
        HALF: tl.constexpr, IS_NEOX: tl.constexpr, HAS_K: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    ):
        # Grid: (num_tokens, q head blocks + k head blocks); one launch rotates q and k in place,
        # and each program reads the token's cos/sin row once for a whole tile of heads.
        tok = tl.program_id(0)
        hb = tl.program_id(1)
        pos = tl.load(pos_ptr + tok)
        cols = tl.arange(0, BLOCK_HALF)
        cmask = cols < HALF
        cos = tl.load(cs_ptr + pos * stride_cs + cols, mask=cmask, other=0.0).to(tl.float32)
        sin = tl.load(cs_ptr + pos * stride_cs + HALF + cols, mask=cmask, other=0.0).to(tl.float32)
        if hb < n_q_blocks:
            _rotate_tile(q_ptr, tok, hb * BLOCK_H, n_q_heads, stride_qt, stride_qh, cos, sin,
                         HALF, IS_NEOX, BLOCK_H, BLOCK_HALF)
        else:
            if HAS_K:
                _rotate_tile(k_ptr, tok, (hb - n_q_blocks) * BLOCK_H, n_k_heads, stride_kt,
                             stride_kh, cos, sin, HALF, IS_NEOX, BLOCK_H, BLOCK_HALF)


def apply_rotary_triton(
    q: torch.Tensor,
    k: torch.Tensor | None,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    rotary_dim: int,
    is_neox: bool = True,
):
    """Triton RoPE, IN PLACE on q and k (their last dim must be contiguous); returns (q, k)."""
    assert q.dim() == 3 and q.stride(-1) == 1, "q must be [num_tokens, num_heads, head_dim], last dim contiguous"
    assert rotary_dim % 2 == 0 and rotary_dim <= q.shape[-1]
    assert cos_sin_cache.stride(-1) == 1
    num_tokens, n_q_heads, _ = q.shape
    if k is not None:
        assert k.dim() == 3 and k.stride(-1) == 1 and k.shape[0] == num_tokens
        n_k_heads, skt, skh = k.shape[1], k.stride(0), k.stride(1)
    else:
        n_k_heads, skt, skh = 0, 0, 0
    if num_tokens == 0:
        return q, k
    half = rotary_dim // 2
    BLOCK_HALF = max(2, next_pow2(half))
    # Bound the tile to ~4K elements per operand so many-head models still fit in registers.
    BLOCK_H = max(1, min(next_pow2(max(n_q_heads, n_k_heads, 1)), max(1, 4096 // BLOCK_HALF)))
    n_q_blocks = triton.cdiv(n_q_heads, BLOCK_H)
    n_k_blocks = triton.cdiv(n_k_heads, BLOCK_H) if k is not None else 0
    _rotary_kernel[(num_tokens, n_q_blocks + n_k_blocks)](
        q, k if k is not None else q, positions, cos_sin_cache,
        n_q_heads, n_k_heads, q.stride(0), q.stride(1), skt, skh, cos_sin_cache.stride(0),
        n_q_blocks,
        HALF=half, IS_NEOX=is_neox, HAS_K=k is not None,
        BLOCK_H=BLOCK_H, BLOCK_HALF=BLOCK_HALF, num_warps=4,
    )
    return q, k
