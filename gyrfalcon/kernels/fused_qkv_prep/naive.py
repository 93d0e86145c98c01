"""The unfused composition of the references: the fused kernels' oracle (and the CPU path)."""

from __future__ import annotations

from typing import Optional

import torch

from gyrfalcon.kernels.rms_norm.naive import apply_row_scale_ref, rms_norm_ref
from gyrfalcon.kernels.rotary.naive import apply_rotary_ref
from gyrfalcon.kernels.store_kv.naive import store_kv_ref


def qkv_prep_ref(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                 positions: torch.Tensor, cos_sin_cache: torch.Tensor, rotary_dim: int, is_neox: bool,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 q_norm_weight: Optional[torch.Tensor] = None, k_norm_weight: Optional[torch.Tensor] = None,
                 eps: float = 1e-6, row_scale=None) -> torch.Tensor:
    """The unfused composition of the existing references (the oracle of the fused kernel). row_scale =
    (x [T, hidden], eps): the layer's input norm folded into the qkv GEMM (folded norms), so each
    row is first scaled by rstd(x) (rms_norm.apply_row_scale_ref)."""
    T = qkv.shape[0]
    if row_scale is not None:
        qkv = apply_row_scale_ref(qkv, row_scale)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.reshape(T, num_heads, head_dim)
    k = k.reshape(T, num_kv_heads, head_dim)
    v = v.reshape(T, num_kv_heads, head_dim)
    if q_norm_weight is not None:
        q = rms_norm_ref(q, q_norm_weight, eps)
    if k_norm_weight is not None:
        k = rms_norm_ref(k, k_norm_weight, eps)
    q, k = apply_rotary_ref(q, k, positions, cos_sin_cache, rotary_dim, is_neox)
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping)
    return q.contiguous()
