"""The Triton attention backend: the GPU path's kernels and their launch policy.

Decode steps run the fused prep inside the split-KV decode launch (kernels/paged_decode_attention.py
decode_attention_with_prep: q/k norm, RoPE and the K/V write in the attention launch, one kernel fewer per
layer); other steps (prefill chunks, verify steps of 1 + k tokens per sequence) run the fused qkv prep
(kernels/fused_qkv_prep.py) and the varlen causal kernel (kernels/paged_attention.py). The decode kernels pick
their own splits and tiles (batch.decode_num_splits None: from the batch shape and the block-table width).
"""

from __future__ import annotations

from typing import Dict, List

import torch

from gyrfalcon.kernels.fused_qkv_prep import qkv_prep_triton
from gyrfalcon.kernels.paged_attention import paged_attention_triton
from gyrfalcon.kernels.decode_attention import (decode_attention_with_prep_triton,
                                                paged_decode_attention_triton, wide_tile_context)
from gyrfalcon.kernels.store_kv import store_kv_triton
from gyrfalcon.layers.attention.backend import PagedOpsBackend

# Decode batches of up to ONE_SPLIT_MAX_BATCH sequences get a one-split graph, replayed while every context fits
# ONE_SPLIT_CONTEXT tokens (one 128-key tile): the main graph's split launch is sized for the block table's full
# width (a graph cannot depend on the actual lengths) and adds a reduce launch per layer, where one split does the
# same work in one launch. Past one tile the one-split launch walks every tile in one program and loses to the
# splits; from batch 16 on it lost even within one tile.
ONE_SPLIT_MAX_BATCH = 4
ONE_SPLIT_CONTEXT = 128


def one_split_graph_limits(batch_sizes: List[int], num_kv_heads: int, kv_elem_size: int, max_model_len: int,
                           device: torch.device) -> Dict[int, int]:
    """{batch size: context limit} of the one-split graphs: ONE_SPLIT_CONTEXT for the sizes up to
    ONE_SPLIT_MAX_BATCH, and the sizes whose one-split launch takes the wide 256-key tile
    (paged_decode_attention.wide_tile_context: batch 5-16 at 8 kv heads on a 2-byte cache) up to that tile. A
    limit must fall short of max_model_len (else the main graph serves every context anyway)."""
    limits: Dict[int, int] = {}
    if ONE_SPLIT_CONTEXT < max_model_len:
        limits = {s: ONE_SPLIT_CONTEXT for s in batch_sizes if s <= ONE_SPLIT_MAX_BATCH}
    for s in batch_sizes:
        wide = wide_tile_context(s * num_kv_heads, kv_elem_size, device)
        if s not in limits and 0 < wide < max_model_len:
            limits[s] = wide
    return dict(sorted(limits.items()))


class TritonBackend(PagedOpsBackend):
    """backend.py has the contract; this module's docstring the kernels."""

    name = "triton"
    store_kv_op = staticmethod(store_kv_triton)
    decode_op = staticmethod(paged_decode_attention_triton)
    prefill_op = staticmethod(paged_attention_triton)
    qkv_prep_op = staticmethod(qkv_prep_triton)

    def forward_fused(self, layer, qkv, positions, rotary, norms=None, row_scale=None):
        fb, k_cache, v_cache = self.context(layer)
        if not fb.is_decode:
            return super().forward_fused(layer, qkv, positions, rotary, norms, row_scale)
        # A decode step: the q/k norm, RoPE and K/V store inside the split-KV attention launch.
        qw, kw, eps = self.split_norms(norms)
        H, Hkv, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
        o = decode_attention_with_prep_triton(qkv, H, Hkv, D, positions, rotary.cos_sin_cache, rotary.rotary_dim,
                                              rotary.is_neox, k_cache, v_cache, fb.slot_mapping, fb.block_tables,
                                              fb.seq_lens, layer.scale, fb.decode_num_splits, qw, kw, eps,
                                              row_scale=row_scale)
        return o.reshape(o.shape[0], H * D)

    def graph_variants(self, batch_sizes: List[int], num_kv_heads: int, kv_elem_size: int, max_model_len: int,
                       device: torch.device) -> Dict[int, int]:
        return one_split_graph_limits(batch_sizes, num_kv_heads, kv_elem_size, max_model_len, device)
