"""ForwardBatch: the device tensors of one step, built from the scheduler's ScheduledBatch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np
import torch


@dataclass
class ForwardBatch:
    """All tensors on the runner's device. T = tokens this step, B = sequences, S = sampled rows.

    input_ids: [T] int64, positions: [T] int64, slot_mapping: [T] int64 (-1: write nothing),
    query_start_loc: [B + 1] int32, seq_lens: [B] int32 (context incl. this step's tokens),
    block_tables: [B, max_blocks] int32, logits_indices: [S] int64 (rows of the hidden states
    whose next token is sampled; the others are prefill chunks that stop mid-prompt).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    logits_indices: torch.Tensor
    is_decode: bool  # every sequence runs exactly one token
    max_query_len: int
    max_seq_len: int
    num_seqs: int
    decode_num_splits: Optional[int] = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def build_forward_batch(sched_reqs, block_size: int, device: torch.device,
                        last_rows: Optional[Dict[str, int]] = None,
                        last_sampled: Optional[torch.Tensor] = None) -> ForwardBatch:
    """Host-side preparation: one pass over the scheduled requests, one copy per tensor.

    A request whose last token was sampled by the previous step but has not reached the host yet
    (scheduling ahead of the device) gets that token from `last_sampled[last_rows[request_id]]`,
    on the device."""
    B = len(sched_reqs)
    q_lens = np.fromiter((sr.num_new_tokens for sr in sched_reqs), dtype=np.int64, count=B)
    starts = np.fromiter((sr.start for sr in sched_reqs), dtype=np.int64, count=B)
    seq_lens = starts + q_lens
    qsl = np.zeros(B + 1, dtype=np.int64)
    np.cumsum(q_lens, out=qsl[1:])
    T = int(qsl[-1])
    input_ids = np.empty(T, dtype=np.int64)
    positions = np.empty(T, dtype=np.int64)
    max_blocks = max((len(sr.request.block_ids) for sr in sched_reqs), default=1) or 1
    block_tables = np.zeros((B, max_blocks), dtype=np.int32)
    sample_rows: List[int] = []
    pending_rows: List[int] = []
    pending_src: List[int] = []
    for i, sr in enumerate(sched_reqs):
        req = sr.request
        s, e = int(qsl[i]), int(qsl[i + 1])
        start = int(starts[i])
        n_prompt = req.num_prompt_tokens
        # The tokens to run: the rest of the prompt and/or outputs (recompute after preemption).
        known = min(e - s, req.num_tokens - start)
        if start + known <= n_prompt:
            input_ids[s:s + known] = req.prompt_token_ids[start:start + known]
        else:
            input_ids[s:s + known] = req.all_token_ids[start:start + known]
        if known < e - s:  # the last token is still on the device
            assert known == e - s - 1 and last_rows is not None, "only a decode token can be in flight"
            input_ids[e - 1] = 0
            pending_rows.append(e - 1)
            pending_src.append(last_rows[req.request_id])
        positions[s:e] = np.arange(start, start + (e - s))
        nb = len(req.block_ids)
        block_tables[i, :nb] = req.block_ids
        if sr.sample:
            sample_rows.append(e - 1)
    # slot = block_id * block_size + offset, looked up per token from its sequence's table.
    seq_of_token = np.repeat(np.arange(B), q_lens)
    slot_mapping = (block_tables[seq_of_token, positions // block_size].astype(np.int64) * block_size
                    + positions % block_size)

    def to(a: np.ndarray, dtype) -> torch.Tensor:
        t = torch.from_numpy(a).to(dtype)
        if device.type == "cuda":
            return t.pin_memory().to(device, non_blocking=True)
        return t

    ids = to(input_ids, torch.int64)
    if pending_rows:
        rows = to(np.asarray(pending_rows, dtype=np.int64), torch.int64)
        src = to(np.asarray(pending_src, dtype=np.int64), torch.int64)
        ids[rows] = last_sampled[src]
    return ForwardBatch(
        input_ids=ids, positions=to(positions, torch.int64),
        slot_mapping=to(slot_mapping, torch.int64), query_start_loc=to(qsl, torch.int32),
        seq_lens=to(seq_lens, torch.int32), block_tables=to(block_tables, torch.int32),
        logits_indices=to(np.asarray(sample_rows, dtype=np.int64), torch.int64),
        is_decode=bool(B > 0 and (q_lens == 1).all()),
        max_query_len=int(q_lens.max()) if B else 0, max_seq_len=int(seq_lens.max()) if B else 0,
        num_seqs=B)
