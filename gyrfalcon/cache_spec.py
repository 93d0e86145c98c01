"""What each layer keeps per token or per request, as the model declares it (`model.kv_cache_specs()`).

Plain data, no torch: the engine's BlockManager / StateManager plan with these, the runner allocates from
them, the layers read their tensors back through the forward context. dtype is a torch dtype's name
("bfloat16", "float8_e4m3fn", ...), so the engine never imports torch.

Kinds:
- FullAttentionSpec: paged K and V, each [num_blocks, block_size, num_kv_heads, head_dim].
- MLALatentSpec: one paged tensor [num_blocks, block_size, 1, kv_lora_rank + rope_dim] (DeepSeek's
  compressed latent and its decoupled RoPE key, one shared "head").
- IndexerKeySpec: one paged tensor [num_blocks, block_size, 1, index_head_dim] (DeepSeek sparse
  attention's lightning-indexer keys).
- SparseMLASpec: an MLALatentSpec and an IndexerKeySpec of the same layer (DeepSeek-V3.2: every layer's MLA has
  its own indexer), allocated as the pair (latent, keys), each in its part's dtype. One spec per layer keeps the
  runner's cache list indexed by layer.
- LinearStateSpec: per request, no paging: a conv window [conv_shape] and a recurrent state
  [recurrent_shape] in one slot of a [num_slots, ...] pool (Gated DeltaNet).

Every paged spec is indexed by token position with one block size, so all paged layers share one block
table (one "paged" cache group; its pages differ in bytes per layer); state layers form the "state" group,
whose requests hold one slot each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple, Union

_ELEM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1,
               "uint8": 1}


def elem_bytes(dtype: str) -> int:
    try:
        return _ELEM_BYTES[dtype]
    except KeyError:
        raise ValueError(f"Unknown cache dtype {dtype!r}") from None


@dataclass(frozen=True)
class FullAttentionSpec:
    num_kv_heads: int
    head_dim: int
    dtype: str
    kind = "full_attention"
    paged = True

    def tensor_shapes(self) -> Dict[str, Tuple[int, ...]]:
        """Per-token shape of each tensor (after [num_blocks, block_size])."""
        return {"k": (self.num_kv_heads, self.head_dim), "v": (self.num_kv_heads, self.head_dim)}

    def page_bytes(self, block_size: int) -> int:
        return 2 * block_size * self.num_kv_heads * self.head_dim * elem_bytes(self.dtype)


@dataclass(frozen=True)
class MLALatentSpec:
    kv_lora_rank: int
    rope_dim: int
    dtype: str
    kind = "mla_latent"
    paged = True

    def tensor_shapes(self) -> Dict[str, Tuple[int, ...]]:
        return {"latent": (1, self.kv_lora_rank + self.rope_dim)}

    def page_bytes(self, block_size: int) -> int:
        return block_size * (self.kv_lora_rank + self.rope_dim) * elem_bytes(self.dtype)


@dataclass(frozen=True)
class IndexerKeySpec:
    index_head_dim: int
    dtype: str
    kind = "indexer_keys"
    paged = True

    def tensor_shapes(self) -> Dict[str, Tuple[int, ...]]:
        return {"keys": (1, self.index_head_dim)}

    def page_bytes(self, block_size: int) -> int:
        return block_size * self.index_head_dim * elem_bytes(self.dtype)


@dataclass(frozen=True)
class SparseMLASpec:
    latent: MLALatentSpec
    indexer: IndexerKeySpec
    kind = "sparse_mla"
    paged = True

    def parts(self) -> Tuple[MLALatentSpec, IndexerKeySpec]:
        return self.latent, self.indexer

    def tensor_shapes(self) -> Dict[str, Tuple[int, ...]]:
        return {**self.latent.tensor_shapes(), **self.indexer.tensor_shapes()}

    def page_bytes(self, block_size: int) -> int:
        return self.latent.page_bytes(block_size) + self.indexer.page_bytes(block_size)


@dataclass(frozen=True)
class LinearStateSpec:
    conv_shape: Tuple[int, ...]
    recurrent_shape: Tuple[int, ...]
    dtype: str  # the conv window's
    state_dtype: str = "float32"  # the recurrent matrix's
    kind = "linear_state"
    paged = False

    def slot_bytes(self) -> int:
        n_conv = n_rec = 1
        for d in self.conv_shape:
            n_conv *= d
        for d in self.recurrent_shape:
            n_rec *= d
        return n_conv * elem_bytes(self.dtype) + n_rec * elem_bytes(self.state_dtype)


CacheSpec = Union[FullAttentionSpec, MLALatentSpec, IndexerKeySpec, SparseMLASpec, LinearStateSpec]


@dataclass
class CacheGroup:
    """Layers that share one allocation scheme: "paged" (one block table per request, every layer's pages
    indexed by the same block ids) or "state" (one slot per request)."""

    kind: str
    layers: List[int] = field(default_factory=list)
    specs: Dict[int, CacheSpec] = field(default_factory=dict)

    def bytes_per_block(self, block_size: int) -> int:
        """paged: bytes one block id holds over every layer of the group."""
        return sum(s.page_bytes(block_size) for s in self.specs.values())

    def bytes_per_slot(self) -> int:
        """state: bytes one request's slot holds over every layer of the group."""
        return sum(s.slot_bytes() for s in self.specs.values())


def group_specs(specs: Dict[int, CacheSpec]) -> Dict[str, CacheGroup]:
    """{layer index: spec} -> {"paged": group, "state": group}, each present only when some layer needs it.
    Layers without a cache (a model may declare none for some) appear in no group."""
    groups: Dict[str, CacheGroup] = {}
    for layer in sorted(specs):
        spec = specs[layer]
        kind = "paged" if spec.paged else "state"
        g = groups.setdefault(kind, CacheGroup(kind))
        g.layers.append(layer)
        g.specs[layer] = spec
    return groups
