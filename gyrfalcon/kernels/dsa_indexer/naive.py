"""Plain-torch lightning-indexer scores, top-k and key-cache write (the CPU path and the kernels' oracle); shapes
in the package docstring."""

from __future__ import annotations

import torch

# Bound on the fp32 [queries, heads, keys] product materialized at once (bytes): long prompts go in query chunks.
_REF_SCORE_BYTES = 1 << 28


def store_index_keys_ref(k: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k [T, D] -> cache[block, offset, 0] = k at each slot >= 0."""
    slots = slot_mapping.reshape(-1).long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, k = slots[keep], k[keep]
    block_size = cache.shape[1]
    cache[slots // block_size, slots % block_size, 0] = k.to(cache.dtype)


def gather_keys_ref(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Un-page one sequence: cache [num_blocks, block_size, 1, D] -> [seq_len, D]."""
    n_blocks = -(-seq_len // cache.shape[1])
    return cache.index_select(0, block_table[:n_blocks].long()).flatten(0, 1)[:seq_len, 0]


def _score_rows(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, q_pos0: int) -> torch.Tensor:
    """q [t, H, D] at positions q_pos0.., w [t, H], keys [S, D] -> [t, S] fp32: sum_h w_h relu(q_h . k), -inf at the
    keys after each query's position (causal)."""
    dots = torch.einsum("thd,sd->ths", q.float(), keys.float())
    scores = torch.einsum("th,ths->ts", w.float(), torch.relu(dots))
    q_pos = q_pos0 + torch.arange(q.shape[0], device=q.device)
    key_pos = torch.arange(keys.shape[0], device=q.device)
    return scores.masked_fill(key_pos[None, :] > q_pos[:, None], float("-inf"))


def _chunks(q_len: int, n_heads: int, seq_len: int):
    step = max(1, _REF_SCORE_BYTES // max(1, 4 * n_heads * seq_len))
    for s in range(0, q_len, step):
        yield s, min(q_len, s + step)


def indexer_scores_ref(q: torch.Tensor, w: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                       seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
    """Index scores of a ragged batch before top-k -> [T, W] fp32, W = block_tables' width x block_size: column j
    is the query's sequence's key position j, -inf past the query's position (and for rows of no sequence)."""
    W = block_tables.shape[1] * cache.shape[1]
    out = torch.full((q.shape[0], W), float("-inf"), dtype=torch.float32, device=q.device)
    qsl = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        qs, qe = qsl[i], qsl[i + 1]
        if qe == qs or seq_len == 0:
            continue
        keys = gather_keys_ref(cache, block_tables[i], seq_len)
        for s, e in _chunks(qe - qs, q.shape[1], seq_len):
            out[qs + s:qs + e, :seq_len] = _score_rows(q[qs + s:qs + e], w[qs + s:qs + e], keys,
                                                       seq_len - (qe - qs) + s)
    return out


def _order_keys(scores: torch.Tensor) -> torch.Tensor:
    """scores [t, S] fp32 -> int64 [t, S], one distinct key per entry ordered as (score, then LOWER position first):
    the score's bits mapped to an int32 that sorts as the float does (negative floats' magnitude bits flipped; -0.0
    made +0.0 first so it ties with +0.0 as the floats do) in the high word, S - 1 - position in the low word."""
    bits = (scores.float() + 0.0).view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    pos = torch.arange(scores.shape[-1] - 1, -1, -1, dtype=torch.int64, device=scores.device)
    return (ordered << 32) | pos


# Bound on the int64 keys select_topk builds at once (bytes): rows go in chunks.
_TOPK_KEY_BYTES = 1 << 28


def select_topk(scores: torch.Tensor, index_topk: int) -> torch.Tensor:
    """scores [t, S] (-inf: not a candidate) -> int32 [t, index_topk]: the key positions of the min(index_topk,
    candidates) highest scores, -1 in the remaining columns. Equal scores go to the LOWER position, whatever S is.

    Why not torch.topk on the scores: exact ties are common (a key whose dot with every index head's query is <= 0
    scores exactly 0 after the relu; with few index heads a good share of a sequence's keys do), and torch.topk's
    choice among equal values depends on the row's layout: a one-token step's row has position + 1 columns, a verify
    step's (1 + k rows of one sequence, speculative decoding) or a chunked-prefill step's row has the whole context
    with -inf after the position, the Triton path's has the block table's width. A different tied key changes MLA's
    output, so speculative decoding and chunked prefill would not reproduce one-token steps. Ranking by (score,
    position) as one distinct int64 key makes the selection a function of the scores alone."""
    k = min(index_topk, scores.shape[-1])
    out = torch.full((scores.shape[0], index_topk), -1, dtype=torch.int32, device=scores.device)
    if k == 0:
        return out
    step = max(1, _TOPK_KEY_BYTES // max(1, 8 * scores.shape[-1]))
    for s in range(0, scores.shape[0], step):
        rows = scores[s:s + step]
        idx = _order_keys(rows).topk(k, dim=-1).indices
        none = rows.gather(-1, idx) == float("-inf")
        out[s:s + step, :k] = torch.where(none, torch.full_like(idx, -1), idx).to(torch.int32)
    return out


def indexer_topk_ref(q: torch.Tensor, w: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, query_start_loc: torch.Tensor, index_topk: int) -> torch.Tensor:
    """The selected key positions per query token -> int32 [T, index_topk] (-1: no key), query chunk by query chunk
    (never the whole [T, W] score matrix). Loops over sequences on the host (tolist: not for CUDA graphs)."""
    out = torch.full((q.shape[0], index_topk), -1, dtype=torch.int32, device=q.device)
    qsl = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        qs, qe = qsl[i], qsl[i + 1]
        if qe == qs or seq_len == 0:
            continue
        keys = gather_keys_ref(cache, block_tables[i], seq_len)
        for s, e in _chunks(qe - qs, q.shape[1], seq_len):
            scores = _score_rows(q[qs + s:qs + e], w[qs + s:qs + e], keys, seq_len - (qe - qs) + s)
            out[qs + s:qs + e] = select_topk(scores, index_topk)
    return out
