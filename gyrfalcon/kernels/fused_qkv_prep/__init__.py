"""Fused attention-input preparation: per-head q/k RMSNorm + RoPE + KV-cache write, one launch.

Between the qkv projection and attention, an unfused layer launches q-norm, k-norm, rotary and the
KV store separately (4 kernels for Qwen3, 2 for Llama). Here one program per (token, head) reads its
head of the fused qkv output once, normalizes it (optional), rotates the first rotary_dim dims,
and either writes q to the output or writes k and v straight into the paged cache.

qkv: [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim], rows [q heads | k heads | v heads];
positions: int [num_tokens]; cos_sin_cache: fp32 [max_positions, rotary_dim] (cos | sin);
k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]; slot_mapping: int [num_tokens]
(-1: do not write). Returns q: [num_tokens, num_heads, head_dim] (normalized and rotated).
"""

from __future__ import annotations

from typing import Optional

import torch

from gyrfalcon.kernels.common import use_triton
from gyrfalcon.kernels.fused_qkv_prep.configs import MAX_HEADS_PER_PROGRAM, MULTI_HEAD_MIN_TOKENS, heads_per_program
from gyrfalcon.kernels.fused_qkv_prep.naive import qkv_prep_ref
from gyrfalcon.kernels.fused_qkv_prep.triton import qkv_prep_triton


def qkv_prep(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
             positions: torch.Tensor, cos_sin_cache: torch.Tensor, rotary_dim: int, is_neox: bool,
             k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
             q_norm_weight: Optional[torch.Tensor] = None, k_norm_weight: Optional[torch.Tensor] = None,
             eps: float = 1e-6, row_scale=None) -> torch.Tensor:
    fn = qkv_prep_triton if use_triton(qkv) else qkv_prep_ref
    return fn(qkv, num_heads, num_kv_heads, head_dim, positions, cos_sin_cache, rotary_dim, is_neox,
              k_cache, v_cache, slot_mapping, q_norm_weight, k_norm_weight, eps, row_scale=row_scale)


__all__ = ["MAX_HEADS_PER_PROGRAM", "MULTI_HEAD_MIN_TOKENS", "heads_per_program", "qkv_prep", "qkv_prep_ref",
           "qkv_prep_triton"]
