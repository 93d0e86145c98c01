"""The reference attention backend: plain torch (kernels' *_ref functions), on any device; the CPU path."""

from __future__ import annotations

from typing import Dict, List

import torch

from gyrfalcon.kernels.fused_qkv_prep import qkv_prep_ref
from gyrfalcon.kernels.paged_attention import paged_attention_ref
from gyrfalcon.kernels.decode_attention import paged_decode_attention_ref
from gyrfalcon.kernels.store_kv import store_kv_ref
from gyrfalcon.layers.attention.backend import PagedOpsBackend


class ReferenceBackend(PagedOpsBackend):
    """The unfused composition of the reference ops (the oracle of TritonBackend; backend.py has the contract)."""

    name = "reference"
    store_kv_op = staticmethod(store_kv_ref)
    decode_op = staticmethod(paged_decode_attention_ref)
    prefill_op = staticmethod(paged_attention_ref)
    qkv_prep_op = staticmethod(qkv_prep_ref)

    def graph_variants(self, batch_sizes: List[int], num_kv_heads: int, kv_elem_size: int, max_model_len: int,
                       device: torch.device) -> Dict[int, int]:
        """The Triton backend's variants: off a GPU the graph runner replays nothing but runs each captured step
        eagerly (checking its static inputs), and takes the GPU's choices so that tests cover them."""
        from gyrfalcon.layers.attention.triton import one_split_graph_limits
        return one_split_graph_limits(batch_sizes, num_kv_heads, kv_elem_size, max_model_len, device)
