"""Plain-torch KV-cache write (the CPU path and the kernel's oracle); shapes in the package docstring."""

from __future__ import annotations

import torch


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Plain-torch cache write (the CPU path; boolean masking syncs on CUDA, which is fine here)."""
    slots = slot_mapping.reshape(-1).long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    # Index (block, offset) rather than flattening so non-contiguous cache views work too.
    k_cache[blocks, offsets] = k.to(k_cache.dtype)
    v_cache[blocks, offsets] = v.to(v_cache.dtype)
