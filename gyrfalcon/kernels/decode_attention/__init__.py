"""Single-token decode attention over the paged KV cache.

q: [num_seqs, num_heads, head_dim], one query per sequence at position seq_lens[i] - 1;
k_cache: [num_blocks, block_size, num_kv_heads, head_dim]; v_cache: [..., head_dim_v];
block_tables: int32 [num_seqs, max_blocks_per_seq]; seq_lens: int32 [num_seqs] (0 = CUDA-graph padding
row: output zeros, read nothing). Returns o: [num_seqs, num_heads, head_dim_v] in q.dtype.

decode_attention_with_prep takes the fused qkv rows instead of q and does fused_qkv_prep's work in the
same launch (q/k RMSNorm, RoPE, this step's K/V into the cache): one launch fewer per decode layer (faster
at batch 1, 16 and 64 on the H200; docs/performance.md).

Files: naive.py (the references), configs.py (split counts, tiles, merge and prefetch policy), tiles.py (the
K/V tile and online-softmax jit helpers), split_kv.py (the kernel over a ready query), with_prep.py (the kernel
with the qkv prep fused in), reduce.py (the split merge: in-kernel or the reduce kernel), launch.py (the
launchers).
"""

from __future__ import annotations

import torch

from gyrfalcon.kernels.common import use_triton
from gyrfalcon.kernels.decode_attention.configs import (B1_SPLIT_TILE, MAX_SPLITS, MERGE_IN_KERNEL_MIN_SEQS,
                                                        MID_TILE_CONFIG, SHORT_SPLIT_TOKENS, WIDE_TILE_CONFIG,
                                                        decode_config, default_min_part, default_num_splits, k_rows,
                                                        merge_in_kernel_default, prefetch_default, wide_tile_context)
from gyrfalcon.kernels.decode_attention.naive import decode_attention_with_prep_ref, paged_decode_attention_ref
from gyrfalcon.kernels.decode_attention.launch import decode_attention_with_prep_triton, paged_decode_attention_triton


def decode_attention_with_prep(*args, **kw) -> torch.Tensor:
    """-> o [num_seqs, num_heads, head_dim]; the arguments of decode_attention_with_prep_ref."""
    fn = decode_attention_with_prep_triton if use_triton(args[0]) else decode_attention_with_prep_ref
    return fn(*args, **kw)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Decode attention -> o [num_seqs, num_heads, head_dim_v]; see module docstring."""
    args = (q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits)
    if use_triton(q):
        return paged_decode_attention_triton(*args)
    return paged_decode_attention_ref(*args)


__all__ = ["B1_SPLIT_TILE", "MAX_SPLITS", "MERGE_IN_KERNEL_MIN_SEQS", "MID_TILE_CONFIG", "SHORT_SPLIT_TOKENS",
           "WIDE_TILE_CONFIG",
           "decode_attention_with_prep", "decode_attention_with_prep_ref", "decode_attention_with_prep_triton",
           "decode_config", "default_min_part", "default_num_splits", "k_rows", "merge_in_kernel_default",
           "paged_decode_attention", "paged_decode_attention_ref", "paged_decode_attention_triton", "prefetch_default",
           "wide_tile_context"]
