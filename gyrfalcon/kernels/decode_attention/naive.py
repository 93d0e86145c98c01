"""Plain-torch decode attention and the unfused prep + attention composition (the CPU path and the kernels'
oracles); shapes in the package docstring."""

from __future__ import annotations

import torch

from gyrfalcon.kernels.fused_qkv_prep.naive import qkv_prep_ref


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Plain-torch decode attention, batched: gathers every sequence's blocks up to the longest
    context (padded, masked), so the CPU decode step is a handful of ops rather than a Python loop."""
    n_seqs, n_heads, _ = q.shape
    block_size, n_kv = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(n_seqs, n_heads, v_cache.shape[-1], dtype=q.dtype, device=q.device)
    if n_seqs == 0:
        return out
    lens = seq_lens.long()
    max_len = int(lens.max())
    if max_len == 0:
        return out
    n_blocks = -(-max_len // block_size)
    # Unused block-table entries may hold anything: clamp them into range; they are masked anyway.
    blocks = block_tables[:, :n_blocks].long().clamp(0, k_cache.shape[0] - 1)
    k = k_cache[blocks].flatten(1, 2)[:, :max_len].float()  # [B, S, Hkv, D]
    v = v_cache[blocks].flatten(1, 2)[:, :max_len].float()  # [B, S, Hkv, Dv]
    group = n_heads // n_kv
    qf = q.float().view(n_seqs, n_kv, group, -1)
    scores = torch.einsum("bhgd,bshd->bhgs", qf, k) * scale
    pad = torch.arange(max_len, device=q.device)[None, :] >= lens[:, None]  # [B, S]
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # seq_len 0 rows: all -inf -> zeros
    o = torch.einsum("bhgs,bshd->bhgd", probs, v).reshape(n_seqs, n_heads, -1)
    return o.to(q.dtype)


def decode_attention_with_prep_ref(qkv, num_heads, num_kv_heads, head_dim, positions, cos_sin_cache, rotary_dim,
                                   is_neox, k_cache, v_cache, slot_mapping, block_tables, seq_lens, scale,
                                   num_splits=None, q_norm_weight=None, k_norm_weight=None, eps=1e-6,
                                   row_scale=None):
    """The unfused composition: qkv_prep (norms, RoPE, K/V into the cache), then decode attention.
    row_scale: see qkv_prep_ref (folded input norm)."""
    q = qkv_prep_ref(qkv, num_heads, num_kv_heads, head_dim, positions, cos_sin_cache, rotary_dim, is_neox,
                     k_cache, v_cache, slot_mapping, q_norm_weight, k_norm_weight, eps, row_scale=row_scale)
    return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits)
