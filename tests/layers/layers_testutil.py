"""Layer tests without the runner: a paged KV cache and one step's batch metadata (the ForwardBatch fields that
layers and attention backends read)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch


@dataclass
class StepBatch:
    """positions / slot_mapping: [T] int64; query_start_loc: [B + 1] int32; seq_lens: [B] int32 (context incl.
    this step's tokens); block_tables: [B, W] int32."""
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    is_decode: bool
    max_query_len: int
    max_seq_len: int
    num_seqs: int
    decode_num_splits: Optional[int] = None


def step_batch(starts: Sequence[int], q_lens: Sequence[int], tables: List[List[int]], block_size: int,
               device: torch.device = torch.device("cpu")) -> StepBatch:
    """Sequence i runs q_lens[i] tokens at positions starts[i] .. starts[i] + q_lens[i] - 1 over its blocks
    tables[i]."""
    positions, slots = [], []
    for s, n, table in zip(starts, q_lens, tables):
        for p in range(s, s + n):
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    width = max(len(t) for t in tables)
    bt = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    seq_lens = [s + n for s, n in zip(starts, q_lens)]
    return StepBatch(
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), block_tables=bt.to(device),
        is_decode=all(n == 1 for n in q_lens), max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        num_seqs=len(q_lens))


def kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype=torch.float32,
             device: torch.device = torch.device("cpu")):
    """(k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim], zeros."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
