"""DeepSeek sparse attention's lightning indexer (DeepSeek-V3.2): which cached tokens each query attends to.

Per layer the indexer keeps one key per token, cache [num_blocks, block_size, 1, D] (D = index_head_dim; LayerNorm'd
and roped by the layer), paged by the same block tables as the MLA latent. A query token at position p scores every
key j <= p of its sequence:
    score(j) = sum_h w_h * relu(q_h . k_j)      q: [T, H, D] (H = index_n_heads), w: [T, H] fp32
(the layer folds index_n_heads^-0.5 and index_head_dim^-0.5 into w: relu commutes with a positive scale), and keeps
the min(index_topk, p + 1) best. block_tables: int32 [B, max_blocks]; seq_lens: int32 [B], the context INCLUDING
this step's tokens (their keys already written); query_start_loc: int32 [B + 1]; sequence i's queries sit at
positions seq_lens[i] - q_len_i ... seq_lens[i] - 1.

- store_index_keys(k [T, D], cache, slot_mapping): the step's keys into the cache (slot < 0: skipped), through
  store_kv on the two halves of the row (one launch).
- indexer_topk(...) -> int32 [T, index_topk]: the selected key positions (within the sequence), -1 in the columns
  beyond a query's candidates. On CUDA: the Triton score kernel (triton.py) into a [T, W] fp32 matrix (W = the
  block table's width x block_size; -inf at non-candidates) and select_topk on it, no host sync; elsewhere the
  reference, query chunk by query chunk. Equal scores go to the lower position (select_topk: exact zeros tie often),
  so a query's selection does not depend on how its step laid out the rows (one-token, verify, prefill chunk).
- indexer_scores(...) -> [T, W] fp32: the scores before top-k (tests, and the Triton path's first half).
"""

from __future__ import annotations

import torch

from gyrfalcon.kernels.common import use_triton
from gyrfalcon.kernels.dsa_indexer.naive import (gather_keys_ref, indexer_scores_ref, indexer_topk_ref, select_topk,
                                                 store_index_keys_ref)
from gyrfalcon.kernels.dsa_indexer.triton import indexer_scores_triton, indexer_topk_triton
from gyrfalcon.kernels.store_kv import store_kv


def store_index_keys(k: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k [T, D] -> the cache rows at slot_mapping, in place (module docstring)."""
    half = k.shape[-1] // 2
    store_kv(k[:, None, :half], k[:, None, half:], cache[..., :half], cache[..., half:], slot_mapping)


def indexer_scores(q: torch.Tensor, w: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                   seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
    """Scores before top-k -> [T, W] fp32 (module docstring)."""
    if use_triton(q):
        return indexer_scores_triton(q, w, cache, block_tables, seq_lens, query_start_loc)
    return indexer_scores_ref(q, w, cache, block_tables, seq_lens, query_start_loc)


def indexer_topk(q: torch.Tensor, w: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, query_start_loc: torch.Tensor, index_topk: int) -> torch.Tensor:
    """Selected key positions per query token -> int32 [T, index_topk], -1 padded (module docstring)."""
    if use_triton(q):
        return indexer_topk_triton(q, w, cache, block_tables, seq_lens, query_start_loc, index_topk)
    return indexer_topk_ref(q, w, cache, block_tables, seq_lens, query_start_loc, index_topk)


__all__ = ["gather_keys_ref", "indexer_scores", "indexer_scores_ref", "indexer_scores_triton", "indexer_topk",
           "indexer_topk_ref", "indexer_topk_triton", "select_topk", "store_index_keys", "store_index_keys_ref"]
