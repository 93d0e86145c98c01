"""Variable-length causal attention over the paged KV cache (prefill, chunked prefill, mixed batches).

q: [num_tokens, num_heads, head_dim]; k_cache: [num_blocks, block_size, num_kv_heads, head_dim];
v_cache: [num_blocks, block_size, num_kv_heads, head_dim_v]; block_tables: int32
[num_seqs, max_blocks_per_seq]; seq_lens: int32 [num_seqs], the context length INCLUDING this step's
tokens (already written by store_kv); query_start_loc: int32 [num_seqs + 1].
Sequence i's queries q[qsl[i]:qsl[i+1]] sit at positions seq_lens[i] - q_len_i ... seq_lens[i] - 1 and
the query at position p attends keys 0..p. GQA: head h reads kv head h // (num_heads // num_kv_heads).
Returns o: [num_tokens, num_heads, head_dim_v] in q.dtype.
"""

from __future__ import annotations

import torch

from gyrfalcon.kernels.common import use_triton
from gyrfalcon.kernels.paged_attention.configs import SHORT_QUERY, prefill_config
from gyrfalcon.kernels.paged_attention.naive import gather_kv_ref, paged_attention_ref
from gyrfalcon.kernels.paged_attention.triton import paged_attention_triton


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Causal varlen paged attention -> o [num_tokens, num_heads, head_dim_v]; see module docstring."""
    args = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len, max_seq_len)
    if use_triton(q):
        return paged_attention_triton(*args)
    return paged_attention_ref(*args)


__all__ = ["SHORT_QUERY", "gather_kv_ref", "paged_attention", "paged_attention_ref", "paged_attention_triton",
           "prefill_config"]
