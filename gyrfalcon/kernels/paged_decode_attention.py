"""Single-token decode attention over the paged KV cache.

q: [num_seqs, num_heads, head_dim], one query per sequence at position seq_lens[i] - 1;
k_cache: [num_blocks, block_size, num_kv_heads, head_dim]; v_cache: [..., head_dim_v];
block_tables: int32 [num_seqs, max_blocks_per_seq]; seq_lens: int32 [num_seqs] (0 = CUDA-graph padding
row: output zeros, read nothing). Returns o: [num_seqs, num_heads, head_dim_v] in q.dtype.
"""

from __future__ import annotations

import torch

from gyrfalcon.kernels._common import HAS_TRITON, use_triton


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


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    # Placeholder until the Triton split-KV kernel lands: same results, reference speed.
    return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale)


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
