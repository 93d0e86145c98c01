"""Multi-head latent attention (DeepSeek's MLA) over the paged latent cache, in the absorbed form.

The cache holds one shared row per token: cache [num_blocks, block_size, 1, L + R] = [latent (after
kv_a_layernorm) | roped k_rope], L = kv_lora_rank, R = qk_rope_head_dim. With kv_b_proj's key half folded into
the query (q_nope @ W_UK per head), attention is MQA over those rows:
q: [T, H, L + R] = [q_nope @ W_UK | roped q_rope]; key = the whole row, value = its first L dims;
o: [T, H, L] (the latent-space output; the caller applies W_UV per head, then o_proj).
block_tables: int32 [B, max_blocks]; seq_lens: int32 [B], the context INCLUDING this step's tokens (already
written by store_latent); query_start_loc: int32 [B + 1]. Sequence i's queries sit at positions
seq_lens[i] - q_len_i ... seq_lens[i] - 1, and position p sees keys 0..p; with indices int32 [T, K] (sparse MLA,
DeepSeek-V3.2: the lightning indexer's top-k, kernels/dsa_indexer; -1: none) only the listed ones of those.

- store_latent(latent [T, L], k_rope [T, R], cache, slot_mapping): the step's rows into the cache (slot < 0:
  skipped), through store_kv on the cache's two column ranges.
- mla_attention(...): on CUDA the split-K kernel (triton.py) for decode steps, one row per sequence; other steps
  dense through the tiled prefill kernel (a program: a few query tokens x a block of heads, each key tile loaded
  once for all of them, causal per row), sparse with one split-K row per query token (its context ending at its
  position, its own index row: the tokens' key lists differ, so no tile shares them); the reference elsewhere.
  (The MHA prefill kernel cannot take MLA's shape: all H heads share one kv head, so its tiles would hold
  H x (L + R) queries.)
- mla_prefill_expanded(...): prefill in the expanded form (expanded.py: per-head K_nope / V rebuilt from the latent
  by kv_b_proj, scores over nope + rope dims, ~3x fewer FLOPs than the absorbed form on long prompts) over contiguous
  context rows the caller gathered, returning each query's log-sum-exp so chunks of a long context merge
  (merge_partials). paged_attention's prefill kernel does not fit: its K has one head per kv head, here the rope
  part is one head shared by every head and K_nope / V are per head (a broadcast copy of k_rope would cost 64 x H
  values a context row).
"""

from __future__ import annotations

import torch

from gyrfalcon.kernels.common import use_triton
from gyrfalcon.kernels.mla_attention.expanded import mla_prefill_expanded_triton
from gyrfalcon.kernels.mla_attention.naive import (gather_latent_ref, merge_partials, mla_attention_ref,
                                                   mla_decode_ref, mla_prefill_expanded_ref, store_latent_ref)
from gyrfalcon.kernels.mla_attention.triton import (mla_decode_triton, mla_prefill_tiled_triton, mla_prefill_triton,
                                                    token_contexts)
from gyrfalcon.kernels.store_kv import store_kv


def store_latent(latent: torch.Tensor, k_rope: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """latent [T, L], k_rope [T, R] -> the cache rows at slot_mapping, in place (module docstring)."""
    L = latent.shape[-1]
    store_kv(latent.unsqueeze(1), k_rope.unsqueeze(1), cache[..., :L], cache[..., L:], slot_mapping)


def mla_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  query_start_loc: torch.Tensor, scale: float, kv_lora_rank: int, is_decode: bool = False,
                  num_splits: int | None = None, indices: torch.Tensor | None = None) -> torch.Tensor:
    """Causal paged MLA attention -> o [T, H, L] (module docstring). is_decode: one query per sequence (the
    split-K kernel, num_splits None: its own choice); indices: the sparse selection, None: dense."""
    if not use_triton(q):
        return mla_attention_ref(q, cache, block_tables, seq_lens, query_start_loc, scale, kv_lora_rank, indices)
    if is_decode:
        return mla_decode_triton(q, cache, block_tables, seq_lens, scale, kv_lora_rank, num_splits, indices=indices)
    if indices is None:
        return mla_prefill_tiled_triton(q, cache, block_tables, seq_lens, query_start_loc, scale, kv_lora_rank)
    return mla_prefill_triton(q, cache, block_tables, seq_lens, query_start_loc, scale, kv_lora_rank,
                              indices=indices)


def mla_prefill_expanded(q_nope: torch.Tensor, q_rope: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor,
                         v: torch.Tensor, cu_q: torch.Tensor, meta: torch.Tensor, scale: float,
                         out_dtype: torch.dtype | None = None):
    """Expanded-form causal MLA over contiguous context rows -> (o [T, H, Dv], lse [T, H] fp32, log2 units); the
    contract in expanded.py's docstring. The Triton kernel on CUDA, the reference elsewhere."""
    fn = mla_prefill_expanded_triton if use_triton(q_nope) else mla_prefill_expanded_ref
    return fn(q_nope, q_rope, k_nope, k_rope, v, cu_q, meta, scale, out_dtype)


__all__ = ["gather_latent_ref", "merge_partials", "mla_attention", "mla_attention_ref", "mla_decode_ref",
           "mla_decode_triton", "mla_prefill_expanded", "mla_prefill_expanded_ref",
           "mla_prefill_expanded_triton", "mla_prefill_tiled_triton", "mla_prefill_triton", "store_latent",
           "store_latent_ref", "token_contexts"]
