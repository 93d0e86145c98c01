"""Rotary position embedding (RoPE) applied to q and k, full or partial, neox or interleaved.

q: [num_tokens, num_q_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim] (or None),
positions: int64 [num_tokens], cos_sin_cache: fp32 [max_positions, rotary_dim] with cos in the first
rotary_dim/2 columns and sin in the last rotary_dim/2. Only the first rotary_dim dims of each head
rotate; the rest pass through. The cache (including llama3 / YaRN scaling) is built by layers/.
"""

from __future__ import annotations

import torch

from gyrfalcon.kernels._common import HAS_TRITON, next_pow2, tl, triton, use_triton


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, is_neox: bool):
    # cos, sin: [num_tokens, 1, rotary_dim/2] fp32, broadcast over heads.
    xf = x.float()
    xr = xf[..., :rotary_dim]
    half = rotary_dim // 2
    if is_neox:  # rotate_half: pairs (i, i + rotary_dim/2)
        x1, x2 = xr[..., :half], xr[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:  # GPT-J style: pairs (2i, 2i+1)
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    if rotary_dim < x.shape[-1]:
        out = torch.cat((out, xf[..., rotary_dim:]), dim=-1)
    return out.to(x.dtype)


def apply_rotary_ref(
    q: torch.Tensor,
    k: torch.Tensor | None,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    rotary_dim: int,
    is_neox: bool = True,
):
    """Plain-torch RoPE; returns new (q_out, k_out) tensors of the input shapes and dtypes."""
    cs = cos_sin_cache.index_select(0, positions.reshape(-1).long()).float()
    half = rotary_dim // 2
    cos = cs[:, :half].unsqueeze(1)
    sin = cs[:, half:rotary_dim].unsqueeze(1)
    q_out = _rotate_ref(q, cos, sin, rotary_dim, is_neox)
    k_out = _rotate_ref(k, cos, sin, rotary_dim, is_neox) if k is not None else None
    return q_out, k_out


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


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor | None,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    rotary_dim: int,
    is_neox: bool = True,
):
    """RoPE on q and k -> (q_out, k_out). On CUDA it runs in place (callers must use the return)."""
    if use_triton(q):
        return apply_rotary_triton(q, k, positions, cos_sin_cache, rotary_dim, is_neox)
    return apply_rotary_ref(q, k, positions, cos_sin_cache, rotary_dim, is_neox)
