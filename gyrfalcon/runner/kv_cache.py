"""The runner's caches, allocated from the specs the model declares (gyrfalcon/cache_spec.py).

One list, indexed by layer: a full-attention layer's (k_cache, v_cache), each [num_blocks, block_size,
num_kv_heads, head_dim]; an MLA layer's latent [num_blocks, block_size, 1, kv_lora_rank + rope_dim]; an
indexer's keys [num_blocks, block_size, 1, index_head_dim]; a sparse-MLA layer's (latent, keys) pair of those
two; a linear-attention layer's (conv [num_slots, *conv_shape], recurrent [num_slots, *recurrent_shape]);
None for a layer that keeps nothing. Layers read their entry through the forward context
(`kv_caches[layer_idx]`). Every paged layer is indexed by the same block ids (one block table per request),
so a block id costs `bytes_per_block` over all of them.

A model with linear-attention layers and prefix caching also gets state snapshots (engine/snapshot_pool.py):
per state layer a (conv [num_snapshots, *conv_shape], recurrent [num_snapshots, *recurrent_shape]) pair beside
the slot pools: restored into slots by copy_states, written by the layers themselves during a prefill step
(ForwardBatch.state_saves). They take SNAPSHOT_MEMORY_SHARE of the cache memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from gyrfalcon.cache_spec import CacheGroup, CacheSpec, group_specs


# The share of the cache memory (after the state slots) that hybrid models' state snapshots get: the rest is KV
# blocks. A snapshot is one slot's bytes (Qwen3.5-397B-A17B: 45 GDN layers x (64 x 128 x 128 fp32 recurrent
# = 4 MiB + 72 KiB conv) = 183 MiB), so a tenth of an H200's ~70 GiB cache holds ~40 of them. Never more
# snapshots than blocks: each one needs a distinct cached block boundary to be of use.
SNAPSHOT_MEMORY_SHARE = 0.1


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

    def split_budget(self, budget: int, snapshots: bool) -> Tuple[int, int]:
        """(num_blocks, num_snapshots) for `budget` bytes of cache memory (the state slots already paid for):
        SNAPSHOT_MEMORY_SHARE of it to state snapshots when `snapshots`, the rest to at least one block."""
        num_snapshots = int(budget * SNAPSHOT_MEMORY_SHARE) // self.bytes_per_slot if snapshots else 0
        num_blocks = max(1, (budget - num_snapshots * self.bytes_per_slot) // self.bytes_per_block)
        return num_blocks, min(num_snapshots, num_blocks)

    def snapshots_beside(self, num_blocks: int) -> int:
        """State snapshots for a cache of a given number of blocks (num_gpu_blocks_override): what the same share
        of memory would give."""
        share = SNAPSHOT_MEMORY_SHARE / (1 - SNAPSHOT_MEMORY_SHARE)
        return min(num_blocks, int(num_blocks * self.bytes_per_block * share) // self.bytes_per_slot)

    def snapshot_stride(self, stride: Optional[int]) -> int:
        """Blocks between the snapshots taken inside a prompt: `stride` when given, else the blocks whose KV bytes
        equal one snapshot's, so a cached prefix's snapshots cost about as much memory as its KV blocks
        (Qwen3.5-397B-A17B: 183 MiB / (16 tokens x 15 attention layers x 2 KV heads x 256 x 2 (K, V) x 2 bytes =
        480 KiB) = 391 blocks, a snapshot every 6256 tokens; Qwen3-Next-80B-A3B: 74 MiB / 384 KiB = 197)."""
        if stride is not None:
            return stride
        return max(1, -(-self.bytes_per_slot // max(self.bytes_per_block, 1)))

    def allocate_snapshots(self, num_snapshots: int, device) -> List[Optional[Any]]:
        """Per layer: a state layer's (conv, recurrent) snapshot pair of [num_snapshots, ...] tensors, else None."""
        snaps: List[Optional[Any]] = [None] * self.num_layers
        if num_snapshots:
            for layer, spec in self.specs.items():
                if spec.kind == "linear_state":
                    snaps[layer] = allocate_layer_cache(spec, 0, self.block_size, num_snapshots, device)
        return snaps

    def allocate(self, num_blocks: int, num_slots: int, device) -> List[Optional[Any]]:
        """State pools get num_slots + 1 rows: slot num_slots (padding_slot) is written by the padding rows of
        captured decode graphs and held by no request."""
        caches: List[Optional[Any]] = [None] * self.num_layers
        for layer, spec in self.specs.items():
            caches[layer] = allocate_layer_cache(spec, num_blocks, self.block_size, num_slots + 1, device)
        return caches

    @staticmethod
    def padding_slot(num_slots: int) -> int:
        """The state pools' spare row (allocate): where a graph's padding rows write their state."""
        return num_slots

    def describe(self, num_blocks: int, num_slots: int, max_model_len: int, num_snapshots: int = 0,
                 snapshot_stride: int = 0) -> str:
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
                         f"{num_slots * self.bytes_per_slot / 2**30:.2f} GiB"
                         + (f", {num_snapshots} snapshots ({num_snapshots * self.bytes_per_slot / 2**30:.2f} GiB, "
                            f"every {snapshot_stride} blocks of a prompt and at its end)" if num_snapshots else ""))
        return "; ".join(parts) or "no caches"


def copy_states(src: Sequence[Optional[Any]], dst: Sequence[Optional[Any]], pairs: Sequence[Tuple[int, int]],
                device) -> None:
    """For every state layer (non-None in both per-layer lists): dst's row j <- src's row i for each (i, j) in
    `pairs` (distinct j), conv window and recurrent state alike. Slot pools and snapshot pools both index rows on
    dim 0: a prefix hit's restore is copy_states(snapshots, caches, ...) (saves need no copy: the Gated DeltaNet
    kernels write the snapshots at their token rows during the forward)."""
    idx = torch.tensor(pairs, dtype=torch.int64).t().contiguous()
    if torch.device(device).type == "cuda":  # pinned and non-blocking: a pageable copy would wait for the device
        idx = idx.pin_memory().to(device, non_blocking=True)
    for s, d in zip(src, dst):
        if s is None or d is None:
            continue
        for a, b in zip(s, d):
            b.index_copy_(0, idx[1], a.index_select(0, idx[0]))


def first_attention_cache(kv_caches) -> Optional[torch.Tensor]:
    """The K cache of the first full-attention layer (its shape and dtype set the decode graphs' policy)."""
    for c in kv_caches:
        if isinstance(c, tuple) and len(c) == 2 and c[0].dim() == 4 and c[0].shape == c[1].shape:
            return c[0]
    return None


def model_cache_specs(model, kv_dtype: torch.dtype) -> Dict[int, CacheSpec]:
    """model.kv_cache_specs for a cache of kv_dtype (the torch dtype's name is what the specs carry)."""
    return model.kv_cache_specs(str(kv_dtype).replace("torch.", ""))
