"""Attention over the paged KV cache, as a layer: its shape, its cache spec, and a call into the backend.

The layer stores this step's K/V into the cache first, then attends from the cache, so chunked prefill
(queries that see a cached prefix), prefix-cache hits, verify steps and decode are one code path. The batch's
metadata and this layer's cache tensors come from the forward context; the kernels from the backend of the
tensors' device (backend.py get_backend).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from gyrfalcon.cache_spec import FullAttentionSpec
from gyrfalcon.forward_context import get_forward_context
from gyrfalcon.layers.attention.backend import get_backend


class Attention(nn.Module):
    """Paged MHA / GQA of one layer: num_heads query heads over num_kv_heads cached K/V heads of head_dim."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_idx: int) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}).")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.layer_idx = layer_idx

    def kv_cache_spec(self, cache_dtype: str) -> FullAttentionSpec:
        """What this layer keeps per token: K and V, num_kv_heads x head_dim each, in cache_dtype (a torch dtype's
        name)."""
        return FullAttentionSpec(self.num_kv_heads, self.head_dim, cache_dtype)

    def kv_cache(self):
        """This layer's (k_cache, v_cache) in the current forward context."""
        return get_forward_context().kv_caches[self.layer_idx]

    def forward(self, q: torch.Tensor, k: Optional[torch.Tensor] = None,
                v: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q: [T, num_heads, head_dim], k / v: [T, num_kv_heads, head_dim] (None: already in the cache)
        -> [T, num_heads * head_dim]."""
        return get_backend(q.device).forward(self, q, k, v)

    def forward_fused(self, qkv: torch.Tensor, positions: torch.Tensor, rotary,
                      norms: Optional[Tuple[Optional[torch.Tensor], Optional[torch.Tensor], float]] = None,
                      row_scale: Optional[Tuple[torch.Tensor, float]] = None) -> torch.Tensor:
        """qkv: [T, (num_heads + 2 * num_kv_heads) * head_dim] -> [T, num_heads * head_dim], with the per-head q/k
        norm (norms), RoPE and the K/V write done by the backend's fused kernels (backend.py)."""
        return get_backend(qkv.device).forward_fused(self, qkv, positions, rotary, norms, row_scale)
