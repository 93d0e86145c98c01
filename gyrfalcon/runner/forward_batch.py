"""ForwardBatch: the device tensors of one step, built from the scheduler's ScheduledBatch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np
import torch

from gyrfalcon.kernels.gated_delta.saves import StateSaves, save_table, state_saves_from_table


@dataclass
class ForwardBatch:
    """All tensors on the runner's device. T = tokens this step, B = sequences, S = sampled rows.

    input_ids: [T] int64, positions: [T] int64, slot_mapping: [T] int64 (-1: write nothing),
    query_start_loc: [B + 1] int32, seq_lens: [B] int32 (context incl. this step's tokens),
    block_tables: [B, max_blocks] int32, logits_indices: [S] int64 (rows of the hidden states
    whose next token is sampled: each sequence's last row, and on a verify step each draft's row too; the
    others are prefill chunks that stop mid-prompt).
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
    # Query tokens of every sequence when they are all alike (1: a decode step; 1 + k: a speculative verify
    # step), else 0 (prefill chunks, mixed steps).
    uniform_query_len: int = 0
    # [B] int32: each sequence's slot in the linear-attention layers' state pools (runner/kv_cache.py), for models
    # with a "state" cache group; else None.
    state_slots: Optional[torch.Tensor] = None
    # Hybrid prefix caching's in-step snapshots (ScheduledBatch.state_saves as token rows of this batch: the
    # linear-attention layers write them during the forward), or None on a step that saves none.
    state_saves: Optional[StateSaves] = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


@dataclass
class HostBatch:
    """A step's inputs on the host (numpy), before they go to the device. T tokens, B sequences,
    S sampled rows, P tokens still on the device (pending_rows: their rows in input_ids, which hold 0
    there; pending_src: their rows in the runner's last_sampled)."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    q_lens: np.ndarray  # [B] int64
    query_start_loc: np.ndarray  # [B + 1] int64
    seq_lens: np.ndarray  # [B] int64
    block_tables: np.ndarray  # [B, W] int32
    sample_rows: List[int]
    pending_rows: List[int]
    pending_src: List[int]
    state_slots: Optional[np.ndarray] = None  # [B] int32, when the requests hold state slots

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)


def pack_host_batch(sched_reqs, block_size: int, last_rows: Optional[Dict[str, int]] = None) -> HostBatch:
    """One pass over the step's rows (step_io.ScheduledRequest, its RequestState attached as .request). A request whose last token was sampled by the
    previous step but has not reached the host yet (scheduling ahead of the device) is marked pending, with
    its row in that step's samples (`last_rows[request_id]`). A verify step's draft tokens follow the
    request's known tokens; every one of its 1 + k rows is sampled."""
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
        # The tokens to run: the rest of the prompt and/or outputs (recompute after preemption), then drafts.
        spec = sr.spec_token_ids
        if spec:
            input_ids[e - len(spec):e] = spec
            e -= len(spec)
        known = min(e - s, req.num_tokens - start)
        input_ids[s:s + known] = req.token_ids(start, start + known)
        if known < e - s:  # the last token is still on the device
            assert known == e - s - 1 and last_rows is not None, "only a decode token can be in flight"
            input_ids[e - 1] = 0
            pending_rows.append(e - 1)
            pending_src.append(last_rows[req.request_id])
        e = int(qsl[i + 1])
        positions[s:e] = np.arange(start, start + (e - s))
        nb = len(req.block_ids)
        block_tables[i, :nb] = req.block_ids
        if sr.sample:
            sample_rows.extend(range(e - 1 - len(spec), e))
    # slot = block_id * block_size + offset, looked up per token from its sequence's table.
    seq_of_token = np.repeat(np.arange(B), q_lens)
    slot_mapping = (block_tables[seq_of_token, positions // block_size].astype(np.int64) * block_size
                    + positions % block_size)
    # A model with linear-attention layers gives every running request a state slot (RequestState.state_slots).
    state_slots = None
    if B and getattr(sched_reqs[0].request, "state_slots", None):
        state_slots = np.fromiter((sr.request.state_slots["state"] for sr in sched_reqs), dtype=np.int32, count=B)
    return HostBatch(input_ids, positions, slot_mapping, q_lens, qsl, seq_lens, block_tables, sample_rows,
                     pending_rows, pending_src, state_slots)


def _save_rows(state_saves, hb: HostBatch) -> np.ndarray:
    """ScheduledBatch.state_saves ((request row, prefix length, snapshot id), the prefix ending inside the row's
    tokens this step) -> the save_table of (sequence, token row of the prefix's last token, snapshot id)."""
    qsl, starts = hb.query_start_loc, hb.seq_lens - hb.q_lens
    return save_table([(i, int(qsl[i] + pos - starts[i]) - 1, sid) for i, pos, sid in state_saves], qsl)


def build_forward_batch(sched_reqs, block_size: int, device: torch.device,
                        last_rows: Optional[Dict[str, int]] = None,
                        last_sampled: Optional[torch.Tensor] = None, state_saves=()) -> ForwardBatch:
    """Host-side preparation (pack_host_batch), then one copy for all the tensors. A pending token is
    read on the device from `last_sampled`. state_saves: ScheduledBatch.state_saves."""
    hb = pack_host_batch(sched_reqs, block_size, last_rows)
    T, B = hb.num_tokens, hb.num_seqs
    input_ids, positions, slot_mapping = hb.input_ids, hb.positions, hb.slot_mapping
    qsl, seq_lens, block_tables, q_lens = hb.query_start_loc, hb.seq_lens, hb.block_tables, hb.q_lens
    sample_rows, pending_rows, pending_src = hb.sample_rows, hb.pending_rows, hb.pending_src
    max_blocks = block_tables.shape[1]

    # One host buffer, one copy to the device: [input_ids T | positions T | slot_mapping T | logits_indices S
    # | pending rows P | pending sources P] as int64, then [query_start_loc B+1 | seq_lens B | block_tables
    # B*W | state slots B (0 without state layers) | the save table (0 without saves)] as int32 packed two per
    # word. (Each copy costs a launch on a slow host.) Every section starts on 16 bytes (int64 sections padded to
    # an even length, int32 ones to a multiple of 4; the save table's own sections too): Triton compiles a kernel
    # per pointer alignment, so a section whose offset followed the token count would compile new variants in the
    # middle of a run (tests/runner/test_jit_specialization.py). For the same reason the block table's width (its
    # row stride, an integer Triton specializes on) is padded to a multiple of 16.
    S, P, W = len(sample_rows), len(pending_rows), -(-max_blocks // 16) * 16
    NS = 0 if hb.state_slots is None else B
    saves = _save_rows(state_saves, hb) if state_saves else None
    NV = 0 if saves is None else len(saves)
    sizes64 = (T, T, T, S, P, P)
    sizes32 = (B + 1, B, B * W, NS, NV)
    offs64, offs32, o = [], [], 0
    for n in sizes64:
        offs64.append(o)
        o += n + (n & 1)
    n64 = o
    o = 0
    for n in sizes32:
        offs32.append(o)
        o += -(-n // 4) * 4
    n32 = o
    host = torch.empty(n64 + n32 // 2, dtype=torch.int64, pin_memory=device.type == "cuda")
    h64 = host.numpy()
    h32 = h64[n64:].view(np.int32)
    for o, arr in zip(offs64, (input_ids, positions, slot_mapping, sample_rows, pending_rows, pending_src)):
        h64[o:o + len(arr)] = arr
    for o, arr in zip(offs32[:2], (qsl, seq_lens)):
        h32[o:o + len(arr)] = arr
    bt = h32[offs32[2]:offs32[2] + B * W].reshape(B, W)
    bt[:, :max_blocks] = block_tables
    bt[:, max_blocks:] = 0
    if NS:
        h32[offs32[3]:offs32[3] + NS] = hb.state_slots
    if NV:
        h32[offs32[4]:offs32[4] + NV] = saves
    dev = host.to(device, non_blocking=True) if device.type == "cuda" else host
    d32 = dev[n64:].view(torch.int32)
    i_ids, i_pos, i_slot, i_sample, i_prow, i_psrc = offs64
    i_qsl, i_sl, i_bt, i_ss, i_sv = offs32
    ids = dev[i_ids:i_ids + T]
    if pending_rows:
        ids[dev[i_prow:i_prow + P]] = last_sampled[dev[i_psrc:i_psrc + P]]
    return ForwardBatch(
        input_ids=ids, positions=dev[i_pos:i_pos + T], slot_mapping=dev[i_slot:i_slot + T],
        query_start_loc=d32[i_qsl:i_qsl + B + 1], seq_lens=d32[i_sl:i_sl + B],
        block_tables=d32[i_bt:i_bt + B * W].view(B, W), logits_indices=dev[i_sample:i_sample + S],
        is_decode=bool(B > 0 and (q_lens == 1).all()),
        uniform_query_len=int(q_lens[0]) if B and (q_lens == q_lens[0]).all() else 0,
        max_query_len=int(q_lens.max()) if B else 0, max_seq_len=int(seq_lens.max()) if B else 0,
        num_seqs=B, state_slots=d32[i_ss:i_ss + NS] if NS else None,
        state_saves=state_saves_from_table(d32[i_sv:i_sv + NV], B, len(state_saves)) if NV else None)
