"""The runner's caches, allocated from the specs the model declares (gyrfalcon/cache_spec.py).

One list, indexed by layer: a full-attention layer's (k_cache, v_cache), each [num_blocks, block_size,
num_kv_heads, head_dim]; an MLA layer's latent [num_blocks, block_size, 1, kv_lora_rank + rope_dim]; an
indexer's keys [num_blocks, block_size, 1, index_head_dim]; a sparse-MLA layer's (latent, keys) pair of those
two; a linear-attention layer's (conv [num_slots, *conv_shape], recurrent [num_slots, *recurrent_shape]);
None for a layer that keeps nothing. Layers read their entry through the forward context
(`kv_caches[layer_idx]`). Every paged layer is indexed by the same block ids (one block table per request),
so a block id costs `bytes_per_block` over all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from gyrfalcon.cache_spec import CacheGroup, CacheSpec, group_specs


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _zeros(shape, dtype: str, device) -> torch.Tensor:
    return torch.zeros(*shape, dtype=torch_dtype(dtype), device=device)


def allocate_layer_cache(spec: CacheSpec, num_blocks: int, block_size: int, num_slots: int, device) -> Any:
    if spec.kind == "sparse_mla":
        return tuple(allocate_layer_cache(p, num_blocks, block_size, num_slots, device) for p in spec.parts())
    if spec.kind == "linear_state":
        return (_zeros((num_slots, *spec.conv_shape), spec.dtype, device),
                _zeros((num_slots, *spec.recurrent_shape), spec.state_dtype, device))
    tensors = tuple(_zeros((num_blocks, block_size, *shape), spec.dtype, device)
                    for shape in spec.tensor_shapes().values())
    return tensors if len(tensors) > 1 else tensors[0]


@dataclass
class CachePlan:
    """The model's cache groups and what one block / one state slot costs over every layer."""

    num_layers: int
    specs: Dict[int, CacheSpec]
    groups: Dict[str, CacheGroup]
    block_size: int

    @classmethod
    def from_specs(cls, specs: Dict[int, CacheSpec], num_layers: int, block_size: int) -> "CachePlan":
        return cls(num_layers, dict(specs), group_specs(specs), block_size)

    @property
    def bytes_per_block(self) -> int:
        g = self.groups.get("paged")
        return g.bytes_per_block(self.block_size) if g is not None else 0

    @property
    def bytes_per_slot(self) -> int:
        g = self.groups.get("state")
        return g.bytes_per_slot() if g is not None else 0

    @property
    def has_state(self) -> bool:
        return "state" in self.groups

    def allocate(self, num_blocks: int, num_slots: int, device) -> List[Optional[Any]]:
        caches: List[Optional[Any]] = [None] * self.num_layers
        for layer, spec in self.specs.items():
            caches[layer] = allocate_layer_cache(spec, num_blocks, self.block_size, num_slots, device)
        return caches

    def describe(self, num_blocks: int, num_slots: int, max_model_len: int) -> str:
        """One log line: blocks (and slots) per group and the maximum concurrency they allow."""
        parts = []
        g = self.groups.get("paged")
        if g is not None:
            kinds = sorted({s.kind for s in g.specs.values()})
            parts.append(f"paged group ({len(g.layers)} layers: {', '.join(kinds)}): {num_blocks} blocks of "
                         f"{self.block_size} tokens, {num_blocks * self.bytes_per_block / 2**30:.2f} GiB, maximum "
                         f"concurrency for {max_model_len}-token requests "
                         f"{num_blocks * self.block_size / max_model_len:.2f}x")
        g = self.groups.get("state")
        if g is not None:
            parts.append(f"state group ({len(g.layers)} layers): {num_slots} slots, "
                         f"{num_slots * self.bytes_per_slot / 2**30:.2f} GiB")
        return "; ".join(parts) or "no caches"


def first_attention_cache(kv_caches) -> Optional[torch.Tensor]:
    """The K cache of the first full-attention layer (its shape and dtype set the decode graphs' policy)."""
    for c in kv_caches:
        if isinstance(c, tuple) and len(c) == 2 and c[0].dim() == 4 and c[0].shape == c[1].shape:
            return c[0]
    return None


def model_cache_specs(model, kv_dtype: torch.dtype) -> Dict[int, CacheSpec]:
    """model.kv_cache_specs for a cache of kv_dtype (the torch dtype's name is what the specs carry)."""
    return model.kv_cache_specs(str(kv_dtype).replace("torch.", ""))
