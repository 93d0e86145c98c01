"""Plain-torch RoPE (the CPU path and the kernel's oracle); shapes in the package docstring."""

from __future__ import annotations

import torch


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
