"""The reference attention backend: plain torch (kernels' *_ref functions), on any device; the CPU path."""

from __future__ import annotations

from typing import Dict, List

import torch

from gyrfalcon.kernels.fused_qkv_prep import qkv_prep_ref
from gyrfalcon.kernels.paged_attention import paged_attention_ref
from gyrfalcon.kernels.decode_attention import paged_decode_attention_ref
from gyrfalcon.kernels.store_kv import store_kv_ref
from gyrfalcon.layers.attention.backend import AttentionBackend


class ReferenceBackend(AttentionBackend):
    """The unfused composition of the reference ops (the oracle of TritonBackend; backend.py has the contract)."""

    name = "reference"

    def _attend(self, layer, fb, q, k_cache, v_cache) -> torch.Tensor:
        if fb.is_decode:
            o = paged_decode_attention_ref(q, k_cache, v_cache, fb.block_tables, fb.seq_lens, layer.scale,
                                           fb.decode_num_splits)
        else:
            o = paged_attention_ref(q, k_cache, v_cache, fb.block_tables, fb.seq_lens, fb.query_start_loc,
                                    layer.scale, fb.max_query_len, fb.max_seq_len)
        return o.reshape(o.shape[0], layer.num_heads * layer.head_dim)

    def forward(self, layer, q, k, v):
        fb, k_cache, v_cache = self.context(layer)
        if k is not None:
            store_kv_ref(k, v, k_cache, v_cache, fb.slot_mapping)
        return self._attend(layer, fb, q, k_cache, v_cache)

    def forward_fused(self, layer, qkv, positions, rotary, norms=None, row_scale=None):
        fb, k_cache, v_cache = self.context(layer)
        qw, kw, eps = self.split_norms(norms)
        q = qkv_prep_ref(qkv, layer.num_heads, layer.num_kv_heads, layer.head_dim, positions, rotary.cos_sin_cache,
                         rotary.rotary_dim, rotary.is_neox, k_cache, v_cache, fb.slot_mapping, qw, kw, eps,
                         row_scale=row_scale)
        return self._attend(layer, fb, q, k_cache, v_cache)

    def graph_variants(self, batch_sizes: List[int], num_kv_heads: int, kv_elem_size: int, max_model_len: int,
                       device: torch.device) -> Dict[int, int]:
        """The Triton backend's variants: off a GPU the graph runner replays nothing but runs each captured step
        eagerly (checking its static inputs), and takes the GPU's choices so that tests cover them."""
        from gyrfalcon.layers.attention.triton import one_split_graph_limits
        return one_split_graph_limits(batch_sizes, num_kv_heads, kv_elem_size, max_model_len, device)
