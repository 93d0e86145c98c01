"""Attention over the paged KV cache.

The layer stores this step's K/V into the cache first, then attends from the cache, so chunked
prefill (queries that see a cached prefix), prefix-cache hits and decode are one code path. The
batch's metadata and this layer's cache tensors come from the forward context.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import nn

from gyrfalcon.kernels import paged_attention, paged_decode_attention, store_kv
from gyrfalcon.kernels.paged_decode_attention import decode_attention_with_prep, decode_attention_with_prep_triton
from gyrfalcon.forward_context import get_forward_context


def fusion_enabled() -> bool:
    """Fused kernels are on unless GYRFALCON_DISABLE_FUSION=1 (for fused-vs-unfused benchmarks)."""
    return os.environ.get("GYRFALCON_DISABLE_FUSION", "0") != "1"


def small_m_gemv_enabled() -> bool:
    """gyrfalcon's GEMV (with the norm folded in) for decode-sized batches instead of cuBLAS; on unless
    GYRFALCON_SMALL_M_GEMV=0 or fusion is off (benchmarks compare the two in one run)."""
    return fusion_enabled() and os.environ.get("GYRFALCON_SMALL_M_GEMV", "1") != "0"


def decode_prep_fusion_enabled() -> bool:
    """Decode steps fold fused_qkv_prep into the decode-attention launch (one kernel fewer per layer)
    unless GYRFALCON_FUSED_DECODE_PREP=0 (side-by-side benchmarks) or fusion is off."""
    return fusion_enabled() and os.environ.get("GYRFALCON_FUSED_DECODE_PREP", "1") != "0"


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 layer_idx: int) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}).")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.layer_idx = layer_idx

    def kv_cache(self):
        """This layer's (k_cache, v_cache) in the current forward context."""
        return get_forward_context().kv_caches[self.layer_idx]

    def decode_with_prep(self, qkv: torch.Tensor, positions: torch.Tensor, rotary, q_norm_weight, k_norm_weight,
                         eps: float, partials: bool = False, row_scale=None):
        """Decode step from the fused qkv rows [T, (num_heads + 2 * num_kv_heads) * head_dim]: q/k norm,
        RoPE, the K/V store and attention in one split launch (+ the reduce) -> [T, num_heads * head_dim].
        partials=True (Triton only): no reduce; returns the DecodePartials for a consumer to merge. row_scale:
        (x [T, hidden], eps) with the input norm folded into the qkv GEMM (qkv_prep_ref)."""
        fb = get_forward_context().batch
        k_cache, v_cache = self.kv_cache()
        args = (qkv, self.num_heads, self.num_kv_heads, self.head_dim, positions, rotary.cos_sin_cache,
                rotary.rotary_dim, rotary.is_neox, k_cache, v_cache, fb.slot_mapping, fb.block_tables, fb.seq_lens,
                self.scale, fb.decode_num_splits, q_norm_weight, k_norm_weight, eps)
        if partials:
            return decode_attention_with_prep_triton(*args, partials=True, row_scale=row_scale)
        o = decode_attention_with_prep(*args, row_scale=row_scale)
        return o.reshape(o.shape[0], self.num_heads * self.head_dim)

    def forward(self, q: torch.Tensor, k: Optional[torch.Tensor] = None,
                v: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q: [T, num_heads, head_dim], k/v: [T, num_kv_heads, head_dim] -> [T, num_heads * head_dim].
        k and v are None when a fused kernel already wrote them into the cache."""
        ctx = get_forward_context()
        fb = ctx.batch
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        if k is not None:
            store_kv(k, v, k_cache, v_cache, fb.slot_mapping)
        if fb.is_decode:
            o = paged_decode_attention(q, k_cache, v_cache, fb.block_tables, fb.seq_lens, self.scale,
                                       num_splits=fb.decode_num_splits)
        else:
            o = paged_attention(q, k_cache, v_cache, fb.block_tables, fb.seq_lens, fb.query_start_loc,
                                self.scale, max_query_len=fb.max_query_len, max_seq_len=fb.max_seq_len)
        return o.reshape(o.shape[0], self.num_heads * self.head_dim)
