"""Plain-torch paged MLA attention and latent-cache write (the CPU path and the kernels' oracle); shapes in the
package docstring."""

from __future__ import annotations

import torch

# Bound on the fp32 score tensor materialized at once (bytes): long prompts are attended in query chunks.
_REF_SCORE_BYTES = 1 << 28


def store_latent_ref(latent: torch.Tensor, k_rope: torch.Tensor, cache: torch.Tensor,
                     slot_mapping: torch.Tensor) -> None:
    """latent [T, L], k_rope [T, R] -> cache[block, offset, 0] = [latent | k_rope] at each slot >= 0."""
    slots = slot_mapping.reshape(-1).long()
    keep = slots >= 0
    row = torch.cat([latent, k_rope], dim=-1)
    if not bool(keep.all()):
        slots, row = slots[keep], row[keep]
    block_size = cache.shape[1]
    cache[slots // block_size, slots % block_size, 0] = row.to(cache.dtype)


def gather_latent_ref(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Un-page one sequence: cache [num_blocks, block_size, 1, L + R] -> [seq_len, L + R]."""
    n_blocks = -(-seq_len // cache.shape[1])
    return cache.index_select(0, block_table[:n_blocks].long()).flatten(0, 1)[:seq_len, 0]


def _attend_one(q: torch.Tensor, kv: torch.Tensor, q_pos0: int, scale: float, kv_lora_rank: int,
                indices: torch.Tensor | None = None) -> torch.Tensor:
    """q [q_len, H, L + R] at positions q_pos0.., kv [S, L + R] -> [q_len, H, L] fp32; causal: position p sees
    keys 0..p, and with indices [q_len, K] (sparse MLA; -1: none) only the listed ones of those. Every head scores
    against the same row (MQA over the latent), values are its first L dims."""
    q_len, n_heads, _ = q.shape
    seq_len = kv.shape[0]
    kf = kv.float()
    vf = kf[:, :kv_lora_rank]
    out = torch.empty(q_len, n_heads, kv_lora_rank, dtype=torch.float32, device=q.device)
    key_pos = torch.arange(seq_len, device=q.device)
    chunk = max(1, _REF_SCORE_BYTES // max(1, 4 * n_heads * seq_len))
    for s in range(0, q_len, chunk):
        e = min(q_len, s + chunk)
        scores = torch.einsum("qhd,kd->qhk", q[s:e].float(), kf) * scale
        q_pos = q_pos0 + torch.arange(s, e, device=q.device)
        masked = key_pos[None, :] > q_pos[:, None]  # [e - s, S]
        if indices is not None:
            masked = masked | ~_selected(indices[s:e], seq_len)
        scores.masked_fill_(masked[:, None, :], float("-inf"))
        out[s:e] = torch.einsum("qhk,kl->qhl", torch.softmax(scores, dim=-1), vf)
    return out


def _selected(indices: torch.Tensor, seq_len: int) -> torch.Tensor:
    """indices [t, K] (key positions, -1: none) -> bool [t, seq_len], True at the listed positions (a position
    outside the context selects nothing, as in the kernel)."""
    sel = torch.zeros(indices.shape[0], seq_len + 1, dtype=torch.bool, device=indices.device)
    # -1 and positions past the context land in the spare last column, dropped below.
    idx = indices.long()
    sel.scatter_(1, torch.where((idx < 0) | (idx >= seq_len), seq_len, idx), True)
    return sel[:, :seq_len]


def mla_attention_ref(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      query_start_loc: torch.Tensor, scale: float, kv_lora_rank: int,
                      indices: torch.Tensor | None = None) -> torch.Tensor:
    """Causal paged MLA attention of a ragged batch (prefill chunks, decode, mixed) -> o [T, H, L] in q.dtype.
    indices: int32 [T, K], each query's selected key positions (sparse MLA, -1: none), None: every causal key.
    Loops over sequences on the host (tolist: not for CUDA graphs)."""
    out = torch.zeros(q.shape[0], q.shape[1], kv_lora_rank, dtype=q.dtype, device=q.device)
    qsl = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        qs, qe = qsl[i], qsl[i + 1]
        if qe == qs or seq_len == 0:
            continue
        kv = gather_latent_ref(cache, block_tables[i], seq_len)
        sel = indices[qs:qe] if indices is not None else None
        out[qs:qe] = _attend_one(q[qs:qe], kv, seq_len - (qe - qs), scale, kv_lora_rank, sel).to(q.dtype)
    return out


def mla_decode_ref(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   scale: float, kv_lora_rank: int, num_splits: int | None = None,
                   indices: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence (its last position) -> o [B, H, L]; seq_len 0 (a CUDA-graph padding row): zeros.
    num_splits is the Triton kernel's knob; the reference has one split."""
    qsl = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return mla_attention_ref(q, cache, block_tables, seq_lens, qsl, scale, kv_lora_rank, indices)
