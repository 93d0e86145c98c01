"""The attention backend interface: how a paged-attention layer runs on a device, and how its CUDA graphs
are prepared.

A backend reads the step's metadata (runner.forward_batch.ForwardBatch) and the layer's cache tensors from the
forward context. Two run the same math: ReferenceBackend (plain torch: the CPU, or GYRFALCON_KERNELS=ref) and
TritonBackend (the GPU kernels). get_backend(device) picks one.

Shapes: T tokens this step, B sequences, H query heads, Hkv kv heads, D head_dim.
- forward(layer, q, k, v): q [T, H, D], k / v [T, Hkv, D] (or None: already in the cache) -> o [T, H * D].
  This step's k / v go into the cache first, then every query attends causally over its sequence's cache.
- forward_fused(layer, qkv, positions, rotary, norms, row_scale): qkv [T, (H + 2 Hkv) * D], the projection's
  rows; the backend does the per-head q/k RMSNorm (norms = (q_weight [D] | None, k_weight [D] | None, eps), or
  None), RoPE (rotary: layers/rotary.py RotaryEmbedding), the K/V cache write and attention -> o [T, H * D].
  row_scale (x [T, hidden], eps): the qkv rows still need scaling by rstd(x) (folded input norm).
A decode step (every sequence 1 token: batch.is_decode) takes the single-query kernels; any other step, a
prefill chunk or a verify step of 1 + k tokens per sequence, the varlen causal kernel over the cached prefix.

CUDA graphs: graph_variants(...) says which decode batch sizes get a second, "one_split" graph and up to which
context it may replay; capture_metadata(batch, variant) is the batch a graph of that variant captures.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import torch

from gyrfalcon import envs
from gyrfalcon.forward_context import get_forward_context

GRAPH_VARIANTS = ("main", "one_split")


class AttentionBackend:
    """Interface (module docstring); subclasses implement forward, forward_fused and graph_variants."""

    name = "base"

    def forward(self, layer, q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def forward_fused(self, layer, qkv: torch.Tensor, positions: torch.Tensor, rotary,
                      norms: Optional[Tuple[Optional[torch.Tensor], Optional[torch.Tensor], float]] = None,
                      row_scale: Optional[Tuple[torch.Tensor, float]] = None) -> torch.Tensor:
        raise NotImplementedError

    def graph_variants(self, batch_sizes: List[int], num_kv_heads: int, kv_elem_size: int, max_model_len: int,
                       device: torch.device) -> Dict[int, int]:
        """{decode batch size: the largest context (tokens) at which its "one_split" graph may replay}, for the
        sizes that get one; the others replay only their "main" graph."""
        raise NotImplementedError

    def capture_metadata(self, batch, variant: str):
        """The ForwardBatch a graph of `variant` captures over the static inputs `batch`: "main" as it is,
        "one_split" with decode attention in one split per sequence (no split merge)."""
        if variant == "main":
            return batch
        if variant == "one_split":
            return dataclasses.replace(batch, decode_num_splits=1)
        raise ValueError(f"Unknown graph variant {variant!r}; expected one of {GRAPH_VARIANTS}")

    @staticmethod
    def context(layer):
        """(batch, k_cache, v_cache) of `layer` in the current forward context."""
        ctx = get_forward_context()
        k_cache, v_cache = ctx.kv_caches[layer.layer_idx]
        return ctx.batch, k_cache, v_cache

    @staticmethod
    def split_norms(norms) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], float]:
        return norms if norms is not None else (None, None, 1e-6)


class PagedOpsBackend(AttentionBackend):
    """A backend made of four paged-attention ops (each a kernels/ function, with the signature of its reference):
    the K/V store, single-query decode attention, varlen causal attention and the fused qkv prep. The reference
    and Triton backends are this composition over their own ops; Triton adds the fused decode launch."""

    store_kv_op = decode_op = prefill_op = qkv_prep_op = None  # staticmethods in the subclasses

    def _attend(self, layer, fb, q, k_cache, v_cache) -> torch.Tensor:
        if fb.is_decode:
            o = self.decode_op(q, k_cache, v_cache, fb.block_tables, fb.seq_lens, layer.scale, fb.decode_num_splits)
        else:
            o = self.prefill_op(q, k_cache, v_cache, fb.block_tables, fb.seq_lens, fb.query_start_loc, layer.scale,
                                fb.max_query_len, fb.max_seq_len)
        return o.reshape(o.shape[0], layer.num_heads * layer.head_dim)

    def forward(self, layer, q, k, v):
        fb, k_cache, v_cache = self.context(layer)
        if k is not None:
            self.store_kv_op(k, v, k_cache, v_cache, fb.slot_mapping)
        return self._attend(layer, fb, q, k_cache, v_cache)

    def forward_fused(self, layer, qkv, positions, rotary, norms=None, row_scale=None):
        fb, k_cache, v_cache = self.context(layer)
        qw, kw, eps = self.split_norms(norms)
        q = self.qkv_prep_op(qkv, layer.num_heads, layer.num_kv_heads, layer.head_dim, positions,
                             rotary.cos_sin_cache, rotary.rotary_dim, rotary.is_neox, k_cache, v_cache,
                             fb.slot_mapping, qw, kw, eps, row_scale=row_scale)
        return self._attend(layer, fb, q, k_cache, v_cache)


_BACKENDS: Dict[str, AttentionBackend] = {}


def get_backend(device: torch.device) -> AttentionBackend:
    """TritonBackend for a CUDA device (unless GYRFALCON_KERNELS=ref or Triton is missing), else
    ReferenceBackend. One instance of each per process."""
    from gyrfalcon.kernels.common import HAS_TRITON

    name = "triton" if device.type == "cuda" and HAS_TRITON and envs.get().kernels != "ref" else "reference"
    backend = _BACKENDS.get(name)
    if backend is None:
        if name == "triton":
            from gyrfalcon.layers.attention.triton import TritonBackend
            backend = TritonBackend()
        else:
            from gyrfalcon.layers.attention.reference import ReferenceBackend
            backend = ReferenceBackend()
        _BACKENDS[name] = backend
    return backend
