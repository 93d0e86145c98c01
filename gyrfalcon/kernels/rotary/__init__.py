"""Rotary position embedding (RoPE) applied to q and k, full or partial, neox or interleaved.

q: [num_tokens, num_q_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim] (or None),
positions: int64 [num_tokens], cos_sin_cache: fp32 [max_positions, rotary_dim] with cos in the first
rotary_dim/2 columns and sin in the last rotary_dim/2. Only the first rotary_dim dims of each head
rotate; the rest pass through. The cache (including llama3 / YaRN scaling) is built by layers/.
"""

from __future__ import annotations

import torch

from gyrfalcon.kernels.common import use_triton
from gyrfalcon.kernels.rotary.naive import apply_rotary_ref
from gyrfalcon.kernels.rotary.triton import apply_rotary_triton


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


__all__ = ["apply_rotary", "apply_rotary_ref", "apply_rotary_triton"]
