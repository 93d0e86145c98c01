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


def mla_prefill_expanded_ref(q_nope: torch.Tensor, q_rope: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor,
                             v: torch.Tensor, cu_q: torch.Tensor, meta: torch.Tensor, scale: float,
                             out_dtype: torch.dtype | None = None):
    """The expanded MLA prefill's contract (kernels/mla_attention/expanded.py): q_nope [T, H, Dn], q_rope [T, H, R],
    k_nope [N, H, Dn], k_rope [N, R] (shared by the heads), v [N, H, Dv], cu_q [B + 1], meta [B, 3] = (k_start,
    k_len, delta: query i sees key j iff j <= i + delta) -> (o [T, H, Dv] in out_dtype (default q's), lse [T, H]
    fp32 in log2 units, -inf and zeros where a query sees no key). Loops over sequences on the host, queries in
    chunks bounding the fp32 scores."""
    T, H, _ = q_nope.shape
    o = torch.zeros(T, H, v.shape[-1], dtype=out_dtype or q_nope.dtype, device=q_nope.device)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=q_nope.device)
    cq = cu_q.tolist()
    for b, (k_start, k_len, delta) in enumerate(meta.tolist()):
        qs, qe = cq[b], cq[b + 1]
        if qe == qs or k_len == 0:
            continue
        kn = k_nope[k_start:k_start + k_len].float()
        kr = k_rope[k_start:k_start + k_len].float()
        vf = v[k_start:k_start + k_len].float()
        chunk = max(1, _REF_SCORE_BYTES // max(1, 4 * H * k_len))
        for s in range(qs, qe, chunk):
            e = min(qe, s + chunk)
            scores = (torch.einsum("qhd,khd->qhk", q_nope[s:e].float(), kn)
                      + torch.einsum("qhr,kr->qhk", q_rope[s:e].float(), kr)) * scale
            qi = torch.arange(s - qs, e - qs, device=q_nope.device)
            hidden = torch.arange(k_len, device=q_nope.device)[None, :] > qi[:, None] + delta  # [e - s, k_len]
            scores.masked_fill_(hidden[:, None, :], float("-inf"))
            row_lse = torch.logsumexp(scores, dim=-1)  # [e - s, H]; -inf where nothing is visible
            seen = row_lse > float("-inf")
            probs = torch.exp(scores - torch.where(seen, row_lse, torch.zeros_like(row_lse))[..., None])
            o[s:e] = torch.einsum("qhk,khv->qhv", probs, vf).to(o.dtype)
            lse[s:e] = row_lse * 1.4426950408889634
    return o, lse


def merge_partials(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor):
    """Two attention partials of the same queries over disjoint key sets -> their union's: o [T, H, Dv] (each
    normalized over its own keys), lse [T, H] log2 units (-inf: no key) -> (o fp32, lse). Exact: softmax over the
    union reweights each part by 2^(lse_part - lse_union)."""
    m = torch.maximum(lse_a, lse_b)
    m_safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    w_a, w_b = torch.exp2(lse_a - m_safe), torch.exp2(lse_b - m_safe)
    den = w_a + w_b
    den_safe = torch.where(den == 0, torch.ones_like(den), den)
    o = (o_a.float() * (w_a / den_safe)[..., None]) + (o_b.float() * (w_b / den_safe)[..., None])
    return o, torch.where(den == 0, m, m_safe + torch.log2(den_safe))
