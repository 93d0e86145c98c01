"""Scheduler: continuous batching with chunked prefill and preemption by recompute.

There is no prefill phase and decode phase: every request has tokens it still has to run
(`num_tokens - num_computed_tokens`): a whole prompt, a chunk of one, or the one token sampled
last step. Each step hands out a token budget (max_num_batched_tokens): running requests first, in
arrival order, then waiting ones, so new requests join a running batch and prefill chunks share a
step with decode tokens. When blocks run out, the most recently admitted running request is
preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed from
its prompt and the outputs it already has (prefix caching usually makes that cheap).

Models with linear-attention layers (a state slot per request) reuse a cached prefix only where a snapshot of
their state at that block boundary exists too (engine/snapshot_pool.py). A step asks for snapshots at the boundaries
its prefill chunks cross where one is wanted (every `stride` blocks and the prompt's last block boundary): the
layers write them during the forward (ScheduledBatch.state_saves), so chunks are never cut for them.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, List, Optional, Sequence, Set

from gyrfalcon.engine.block_manager import BlockManager
from gyrfalcon.engine.request import Request, RequestStatus
from gyrfalcon.engine.snapshot_pool import SnapshotPool
from gyrfalcon.engine.state_manager import StateManager
from gyrfalcon.step_io import NewRequestData, ScheduledBatch, ScheduledRequest  # noqa: F401 (re-exported)


@dataclass
class RequestUpdate:
    """What one step produced for one request; the front end turns it into text."""

    request_id: str
    new_token_ids: Sequence[int]
    new_logprobs: Sequence[tuple]  # per new token: (logprob, [(token, logprob), ...]) if asked
    finished: bool
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # Prompt logprobs that became known: (first prompt token index, [(logprob, rank, top-N)] per token).
    prompt_logprobs: Optional[tuple] = None


def _history_dependent(req: Request) -> int:
    p = req.sampling_params
    return int(bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 or p.min_tokens
                    or p.structured_outputs is not None))


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, state_manager: Optional[StateManager] = None,
                 snapshots: Optional[SnapshotPool] = None, num_lookahead_tokens: int = 0) -> None:
        self.block_manager = block_manager
        # KV slots past a sampling step's tokens that the runner's draft model writes (its chained passes).
        self.num_lookahead_tokens = num_lookahead_tokens
        # Per-request state slots, for models with linear-attention layers (None: the model has none).
        self.state_manager = state_manager
        # Their state snapshots at block boundaries (None: no prefix caching for such a model).
        self.snapshots = snapshots if state_manager is not None and block_manager.enable_prefix_caching else None
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: Deque[Request] = deque()
        self.running: List[Request] = []
        self.requests: Dict[str, Request] = {}
        self._finished_since_step: Set[str] = set()
        self.num_preemptions_total = 0
        # Unfinished requests whose sampling reads their own output history (penalties, min_tokens, grammars):
        # while there are none, async scheduling never has to wait (Engine._needs_exact_state).
        self.num_history_dependent = 0

    # ---- admission / removal ------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"Request id {request.request_id!r} is already in use.")
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self.num_history_dependent += _history_dependent(request)

    def finish_request(self, request_id: str,
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> Optional[Request]:
        """Stop a request (abort, or a stop string seen by the front end) and free its blocks."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.num_history_dependent -= _history_dependent(request)
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        request.status = status
        self._free(request)
        self._finished_since_step.add(request_id)
        return request

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- one step -------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch(finished_request_ids=self._finished_since_step)
        self._finished_since_step = set()
        if self.snapshots is not None:
            self.snapshots.begin_step()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_output_tokens + req.num_inflight >= req.max_tokens:
                i += 1  # its last token is still being sampled: nothing more to run
                continue
            remaining = req.num_tokens + req.num_inflight - req.num_computed_tokens
            # Draft tokens ride behind the last sampled token (a verify step), never behind a prompt chunk or a
            # token still in flight; at most as many as leave room for the bonus token within max_tokens. (Sampling
            # that reads its own history, penalties and min_tokens, counts the drafts ahead of each row: the
            # runner's sampling metadata.)
            spec: Sequence[int] = ()
            if req.spec_token_ids and remaining == 1 and not req.num_inflight:
                room = min(req.max_tokens - req.num_output_tokens - 1, budget - 1)
                spec = req.spec_token_ids[:max(room, 0)]
            num_new = min(remaining + len(spec), budget)
            if not self.enable_chunked_prefill and num_new < remaining:
                break
            preempted_self = False
            need = num_new + (self._lookahead(req, num_new) if num_new >= remaining else 0)
            while not bm.allocate_slots(req, need):
                victim = self.running.pop()
                self._preempt(victim)
                batch.num_preempted += 1
                if victim is req:
                    preempted_self = True
                    break
            if preempted_self:
                break
            start = req.num_computed_tokens
            self._commit(batch, req, num_new, num_new >= remaining, spec)
            if self.snapshots is not None and start < req.num_prompt_tokens:  # (not decoding)
                self._save_snapshots(batch, req, start, num_new)
            budget -= num_new
            i += 1

        # Admit waiting requests only when nothing was preempted: freed blocks go to the
        # preempted (older) requests first, or they would starve.
        if batch.num_preempted == 0:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
                if req.num_inflight:
                    break  # preempted with a token in flight: it resumes once that token is known
                # A prefix hit skips the cached tokens: with linear-attention layers only up to a block boundary
                # whose state snapshot exists too (restored into the request's slot before the step).
                restore = None
                if self.state_manager is None:
                    hits = bm.get_computed_blocks(req)
                elif self.snapshots is not None:
                    hits, restore = self._snapshot_hits(req)
                else:
                    hits = []
                num_cached = len(hits) * bm.block_size
                remaining = req.num_tokens - num_cached
                num_new = min(remaining, budget)
                if not self.enable_chunked_prefill and num_new < remaining:
                    break
                sm = self.state_manager
                if sm is not None and not sm.num_free_slots:
                    break
                if not bm.allocate_slots(req, num_new + (self._lookahead(req, num_new, num_cached)
                                                         if num_new == remaining else 0), hits):
                    break
                if sm is not None:
                    sm.allocate(req)
                if restore is not None:
                    self.snapshots.touch(restore)
                    batch.state_restores.append((self.snapshots.lookup(restore), req.state_slot))
                if bm.enable_prefix_caching:
                    bm.record_prefix_query(req.num_tokens, num_cached)
                self.waiting.popleft()
                req.num_computed_tokens = num_cached
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = time.monotonic()
                    req.num_cached_tokens = num_cached
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                self._commit(batch, req, num_new, num_new == remaining, ())
                if self.snapshots is not None:
                    self._save_snapshots(batch, req, num_cached, num_new)
                budget -= num_new
        self.num_preemptions_total += batch.num_preempted
        return batch

    # ---- linear-attention state snapshots (hybrid models' prefix caching) -----------------------------
    def _snapshot_hits(self, req: Request):
        """(cached blocks, prefix hash of the snapshot to restore): the longest run of cached prefix blocks that
        ends on a restorable snapshot; ([], None) without one."""
        bm, pool = self.block_manager, self.snapshots
        hits = bm.get_computed_blocks(req)
        for j in range(len(hits), 0, -1):
            h = req.block_hashes[j - 1]
            if pool.lookup(h) is not None:
                return hits[:j], h
        return [], None

    def _save_snapshots(self, batch: ScheduledBatch, req: Request, start: int, num_new: int) -> None:
        """Ask the step just committed for `req` (its last entry in the batch) to snapshot the state at each block
        boundary in (start, start + num_new] where one is wanted and missing: every stride-th boundary, and the
        prompt's last one that a later prompt's hit can use, block (num_prompt_tokens - 1) // block_size (a hit
        always leaves one token to run). Outputs get none. When the pool cannot take them all this step, the
        deepest ones go first (the prompt's end: a chat's next turn); they are reserved shallowest first, so the
        prompt's end is the most recently used."""
        bm, pool = self.block_manager, self.snapshots
        bs, stride = bm.block_size, pool.stride
        last = (req.num_prompt_tokens - 1) // bs  # the prompt's last boundary a hit can use (in blocks)
        hi = min((start + num_new) // bs, last)  # the last boundary this step reaches
        first = start // bs + 1  # the first boundary past start
        js = list(range(-(-first // stride) * stride, hi + 1, stride))
        if first <= last <= hi and (not js or js[-1] != last):
            js.append(last)
        wanted = [(j, h) for j, h in ((j, bm.prefix_hash(req, j)) for j in js) if not pool.contains(h)]
        room = pool.num_available
        if len(wanted) > room:
            wanted = wanted[len(wanted) - room:]
        row = len(batch.reqs) - 1
        for j, h in wanted:
            batch.state_saves.append((row, j * bs, pool.reserve(h)))

    def _lookahead(self, req: Request, num_new: int, num_cached: int = 0) -> int:
        """Lookahead slots for a sampling step of num_new tokens: no further than the request can reach."""
        if not self.num_lookahead_tokens:
            return 0
        end = req.num_computed_tokens + num_cached + num_new
        return max(0, min(self.num_lookahead_tokens, req.num_prompt_tokens + req.max_tokens - end))

    @staticmethod
    def _commit(batch: ScheduledBatch, req: Request, num_new: int, sample: bool, spec: Sequence[int]) -> None:
        """Add `req` to the batch and count its tokens as computed now: the next step can then be
        scheduled before this one's results are back (a sampled token is "in flight" meanwhile)."""
        new_req = None
        if not req.known_to_runner:
            new_req = NewRequestData(req.prompt_token_ids, req.sampling_params, req.eos_token_ids,
                                     list(req.output_token_ids),
                                     {} if req.state_slot is None else {"state": req.state_slot})
            req.known_to_runner = True
        blocks, sent = req.block_ids, req.num_blocks_sent
        # (no slice, and no list, where no block is new: the usual decode step)
        batch.reqs.append(ScheduledRequest(req.request_id, req.num_computed_tokens, num_new, sample,
                                           blocks[sent:] if len(blocks) > sent else (), spec, new_req))
        batch.requests.append(req)
        req.num_blocks_sent = len(blocks)
        req.num_computed_tokens += num_new
        if sample:
            req.num_inflight += 1

    def _free(self, request: Request) -> None:
        self.block_manager.free(request)
        if self.state_manager is not None:
            self.state_manager.free(request)

    def _preempt(self, request: Request) -> None:
        self._free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        request.spec_token_ids = []
        # The runner learns it again, from scratch, when it is resumed (its blocks are gone).
        request.known_to_runner = False
        request.num_blocks_sent = 0
        self.waiting.appendleft(request)

    def update(self, batch: ScheduledBatch, sampled: List[List[int]],
               logprobs: Optional[List[List[tuple]]] = None,
               prompt_logprobs: Optional[List[Optional[list]]] = None,
               spec_token_ids: Optional[List[List[int]]] = None) -> List[RequestUpdate]:
        """Apply one step's results: append sampled tokens, roll back rejected drafts, finish requests
        (computed counts were advanced when the step was scheduled).

        sampled[i]: the tokens batch.reqs[i] produced (empty where it did not sample): one, or on a verify
        step of k drafts the accepted drafts and one more (1..k + 1). logprobs[i]: one entry per token when
        asked. prompt_logprobs[i]: entries for prompt tokens sr.start + 1, sr.start + 2, ...
        spec_token_ids[i]: draft tokens proposed for the request's next step.
        """
        updates: List[RequestUpdate] = []
        for i, sr in enumerate(batch.reqs):
            req = batch.requests[i]
            plp = self._new_prompt_logprobs(req, sr, prompt_logprobs[i] if prompt_logprobs else None)
            if not sr.sample:
                if plp is not None and req.request_id in self.requests:
                    updates.append(RequestUpdate(
                        request_id=req.request_id, new_token_ids=[], new_logprobs=[], finished=False,
                        num_prompt_tokens=req.num_prompt_tokens, prompt_logprobs=plp))
                continue
            req.num_inflight -= 1
            if req.is_finished or self.requests.get(req.request_id) is not req:
                continue  # finished (or aborted) while this step ran: the tokens are surplus
            tokens = sampled[i]
            if sr.spec_token_ids:
                # The K/V of rejected drafts is stale: those positions run again.
                req.num_computed_tokens -= len(sr.spec_token_ids) - (len(tokens) - 1)
            lps = logprobs[i] if logprobs is not None and logprobs[i] else ()
            n = 0
            finished = False
            for t in tokens:
                req.append_output(t, lps[n] if n < len(lps) else None)
                n += 1
                if req.check_stop():
                    finished = True
                    break
            # The runner's lists, cut where the request stopped (no new list in the usual case).
            new_tokens = tokens if n == len(tokens) else tokens[:n]
            new_lps = lps if n >= len(lps) else lps[:n]
            req.spec_token_ids = spec_token_ids[i] if spec_token_ids is not None and spec_token_ids[i] else []
            if finished:
                if req in self.running:
                    self.running.remove(req)
                else:  # preempted while its token was in flight (async scheduling)
                    self.waiting.remove(req)
                if self.requests.pop(req.request_id, None) is not None:
                    self.num_history_dependent -= _history_dependent(req)
                self._free(req)
                self._finished_since_step.add(req.request_id)
            updates.append(RequestUpdate(
                request_id=req.request_id, new_token_ids=new_tokens, new_logprobs=new_lps, finished=finished,
                finish_reason=req.finish_reason, stop_reason=req.stop_reason,
                num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=req.num_cached_tokens,
                prompt_logprobs=plp))
        return updates

    @staticmethod
    def _new_prompt_logprobs(req: Request, sr: ScheduledRequest, entries: Optional[list]) -> Optional[tuple]:
        """The entries for prompt tokens not reported yet (a recompute repeats earlier ones)."""
        if not entries:
            return None
        first = sr.start + 1  # entries[j] is the logprob of prompt token sr.start + 1 + j
        skip = max(0, req.num_prompt_logprobs_sent - first)
        if skip >= len(entries):
            return None
        req.num_prompt_logprobs_sent = first + len(entries)
        return (first + skip, entries[skip:])
