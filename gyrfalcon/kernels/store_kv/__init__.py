"""Write this step's K/V into the paged cache.

k, v: [num_tokens, num_kv_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, num_kv_heads,
head_dim]; slot_mapping: int64 [num_tokens], slot = block_id * block_size + offset_in_block, and a slot
< 0 means "skip" (padding tokens of a CUDA-graph batch). Writes in place, casting to the cache dtype.
"""

from __future__ import annotations

import torch

from gyrfalcon.kernels.common import use_triton
from gyrfalcon.kernels.store_kv.naive import store_kv_ref
from gyrfalcon.kernels.store_kv.triton import store_kv_triton


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k/v into the paged caches at slot_mapping (skipping slots < 0), in place."""
    if use_triton(k):
        store_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        store_kv_ref(k, v, k_cache, v_cache, slot_mapping)


__all__ = ["store_kv", "store_kv_ref", "store_kv_triton"]
