"""Plain-torch paged causal attention (the CPU path and the kernel's oracle); shapes in the package docstring."""

from __future__ import annotations

import torch


# Bound on the fp32 score tensor the reference materializes at once (bytes); queries are chunked
# so a 10k-token prompt on the CPU path does not allocate heads * 10k * 10k floats.
_REF_SCORE_BYTES = 1 << 28


def gather_kv_ref(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Un-page one sequence: cache [num_blocks, block_size, H, D] -> [seq_len, H, D]."""
    block_size = cache.shape[1]
    n_blocks = -(-seq_len // block_size)
    blocks = block_table[:n_blocks].long()
    return cache.index_select(0, blocks).flatten(0, 1)[:seq_len]


def _attend_ref(q, k, v, q_pos0, scale):
    """q [q_len, H, D] at positions q_pos0.., k/v [seq_len, Hkv, D*] -> [q_len, H, Dv] fp32, causal."""
    q_len, n_heads, _ = q.shape
    seq_len, n_kv, _ = k.shape
    group = n_heads // n_kv
    kf = k.float().permute(1, 0, 2)  # [Hkv, S, D]
    vf = v.float().permute(1, 0, 2)  # [Hkv, S, Dv]
    out = torch.empty(q_len, n_heads, v.shape[-1], dtype=torch.float32, device=q.device)
    chunk = max(1, _REF_SCORE_BYTES // max(1, 4 * n_heads * seq_len))
    key_pos = torch.arange(seq_len, device=q.device)
    for s in range(0, q_len, chunk):
        e = min(q_len, s + chunk)
        # [Hkv, G, c, D]: grouping query heads by kv head avoids materializing repeated K/V.
        qf = q[s:e].float().view(e - s, n_kv, group, -1).permute(1, 2, 0, 3)
        scores = torch.einsum("hgqd,hkd->hgqk", qf, kf) * scale
        q_pos = q_pos0 + torch.arange(s, e, device=q.device)
        causal = key_pos[None, :] > q_pos[:, None]  # [c, S]
        scores.masked_fill_(causal, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("hgqk,hkd->hgqd", probs, vf)  # [Hkv, G, c, Dv]
        out[s:e] = o.permute(2, 0, 1, 3).reshape(e - s, n_heads, -1)
    return out


def paged_attention_ref(
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
    """Plain-torch paged attention: loops over sequences, gathers K/V via the block table, fp32 softmax."""
    n_heads = q.shape[1]
    out = torch.zeros(q.shape[0], n_heads, v_cache.shape[-1], dtype=q.dtype, device=q.device)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        qs, qe = qsl[i], qsl[i + 1]
        if qe == qs or seq_len == 0:
            continue
        k = gather_kv_ref(k_cache, block_tables[i], seq_len)
        v = gather_kv_ref(v_cache, block_tables[i], seq_len)
        out[qs:qe] = _attend_ref(q[qs:qe], k, v, seq_len - (qe - qs), scale).to(q.dtype)
    return out
