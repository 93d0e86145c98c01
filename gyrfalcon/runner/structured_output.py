"""StructuredOutputs: the runner's grammar bookkeeping for requests with `structured_outputs` (xgrammar).

Per request: the grammar compiled against the model's vocabulary (once per distinct constraint: compiled
grammars are cached by StructuredOutputsParams.key()) and a GrammarMatcher advanced with every token the request
keeps. Per step: a token bitmask [rows, ceil(V / 32)] int32 (bit t of a row: token t is allowed) filled on the
host for the constrained rows, then applied to those rows' logits on the device before sampling
(apply_token_bitmask: -inf where a bit is 0).

Where it sits in a step (ModelRunner.launch): the forward and the LM head are queued on the device first, then
the host fills the bitmask while the device runs them, then the mask goes over in one copy and is applied inside
the Sampler. A matcher must have accepted every token before the step that samples with its mask, so the engine
waits for the step in flight before scheduling a constrained request (Engine._needs_exact_state), as it does for
penalties; unconstrained requests keep async scheduling.

A thinking model's constraint can wait for the end of its reasoning (StructuredOutputsParams.reasoning_end, set
by the server's --reasoning-parser): until the outputs hold those token ids the request's rows are not masked, and
the matcher reads only what follows them.

Compilation runs on a worker thread from the moment a request reaches the runner, so it overlaps the request's
prefill (on a GPU); the first step that samples from it waits for the result. The vocabulary (xgrammar's
TokenizerInfo: each token's bytes) comes from the model's Hugging Face tokenizer, sized to the model's
vocab_size: the embedding's padding rows have no token and are never allowed.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, List, Optional, Sequence, Tuple

import torch

logger = logging.getLogger(__name__)

# Compiled grammars kept for reuse, least recently used out first: at most this many, and this many bytes (a JSON
# schema's compiled form is kilobytes to a few megabytes).
_CACHE_SIZE = 256
_CACHE_BYTES = 256 << 20


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: logits[rows[i], t] = -inf where bit t of bitmask[i] is 0.

    logits: [S, V] (fp32); rows: [R] int64 row indices; bitmask: [R, W] int32, W = ceil(V' / 32) for the
    grammar's vocabulary V' (tokens at or past W * 32 are not allowed). Plain torch ops, no host sync: the same
    code on the CPU and the GPU (xgrammar's apply_token_bitmask_inplace is the reference in the tests)."""
    S, V = logits.shape
    R, W = bitmask.shape
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().reshape(R, W * 32)
    if W * 32 >= V:
        allowed = allowed[:, :V]
    else:
        allowed = torch.cat([allowed, allowed.new_zeros(R, V - W * 32)], dim=1)
    sub = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, rows, sub)


class _Grammar:
    """One request's grammar state. With `end` (its reasoning's closing token ids) the matcher stays inactive, and
    the request's rows unmasked, until the outputs contain `end`; it then reads the tokens after it."""

    __slots__ = ("future", "matcher", "stop_ids", "end", "active")

    def __init__(self, future: Future, stop_ids: List[int], end: Optional[List[int]]) -> None:
        self.future = future
        self.matcher = None
        self.stop_ids = stop_ids
        self.end = list(end) if end else None
        self.active = end is None


def _find(seq: Sequence[int], sub: List[int], start: int = 0) -> int:
    """The index just past the first occurrence of `sub` in seq[start:], or -1."""
    n = len(sub)
    for i in range(max(0, start), len(seq) - n + 1):
        if seq[i] == sub[0] and list(seq[i:i + n]) == sub:
            return i + n
    return -1


class StructuredOutputs:
    def __init__(self, tokenizer_path: str, trust_remote_code: bool, vocab_size: int) -> None:
        self.tokenizer_path = tokenizer_path
        self.trust_remote_code = trust_remote_code
        self.vocab_size = vocab_size
        self._compiler = None  # xgrammar.GrammarCompiler, built on the worker thread at first use
        self._compiler_lock = threading.Lock()
        self._cache: "OrderedDict[str, Future]" = OrderedDict()
        self._executor: Optional[ThreadPoolExecutor] = None
        self._batch_matcher = None  # xgrammar.BatchGrammarMatcher: fills many requests' rows on its threads
        self.grammars: Dict[str, _Grammar] = {}  # request id -> its grammar state

    # ---- requests ---------------------------------------------------------------------------------
    def update(self, batch) -> None:
        """Follow the batch: drop finished requests, start compiling for new ones (a preempted request that
        comes back gets a fresh matcher, which first replays its outputs)."""
        for rid in batch.finished_request_ids:
            self.grammars.pop(rid, None)
        for sr in batch.reqs:
            new = sr.new_request
            if new is None:
                continue
            spec = new.sampling_params.structured_outputs
            if spec is None:
                self.grammars.pop(sr.request_id, None)
                continue
            self.grammars[sr.request_id] = _Grammar(self._compiled(spec),
                                                    list(new.eos_token_ids) + list(new.sampling_params.stop_token_ids),
                                                    spec.reasoning_end)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.grammars

    def _compiled(self, spec) -> Future:
        key = spec.key()
        fut = self._cache.get(key)
        if fut is not None and not (fut.done() and fut.exception() is not None):
            self._cache.move_to_end(key)
            return fut
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="gyrfalcon-grammar")
        fut = self._executor.submit(self._compile, spec)
        self._cache[key] = fut
        self._evict()
        return fut

    def _evict(self) -> None:
        """Drop the least recently used compiled grammars past the count or byte bound (requests that hold one
        keep it alive; it is only no longer shared)."""
        while len(self._cache) > _CACHE_SIZE:
            self._cache.popitem(last=False)
        sizes = [f.result().memory_size_bytes if f.done() and f.exception() is None else 0
                 for f in self._cache.values()]
        total = sum(sizes)
        for key, size in zip(list(self._cache), sizes):
            if total <= _CACHE_BYTES or len(self._cache) == 1:
                break
            del self._cache[key]
            total -= size

    def _compile(self, spec):
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                from gyrfalcon.tokenizer import load_tokenizer
                tok = load_tokenizer(self.tokenizer_path, self.trust_remote_code)
                # The model's vocab_size (its logits' width), or the tokenizer's if that is larger (added tokens past
                # the embedding: masked out of the logits anyway) or the config has none.
                info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=max(self.vocab_size or 0, len(tok)))
                self.vocab_size = info.vocab_size
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler.compile_grammar(spec.build_grammar())

    def _matcher(self, st):
        """The request's matcher, made at its first use (waiting for its grammar to compile); None if the
        compilation failed: the front end parsed the grammar already, so that is a bug, logged, and the request
        goes on unconstrained rather than the engine stopping for every request."""
        g = self.grammars[st.request_id]
        if g.matcher is None:
            import xgrammar as xgr

            try:
                compiled = g.future.result()
            except Exception:
                logger.exception("request %s: its structured-output grammar did not compile", st.request_id)
                del self.grammars[st.request_id]
                return None
            g.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=g.stop_ids)
            # A resumed (preempted) request's outputs so far (after its reasoning, if that must end first).
            start = 0
            if g.end is not None:
                start = _find(st.output_token_ids, g.end)
                g.active = start >= 0
            if g.active:
                for t in st.output_token_ids[start:]:
                    self._accept(g.matcher, st.request_id, t)
        return g.matcher

    @staticmethod
    def _accept(matcher, request_id: str, token: int) -> bool:
        if matcher.is_terminated():
            return False
        ok = matcher.accept_token(token)
        if not ok:
            logger.warning("request %s: token %d does not fit its grammar", request_id, token)
        return ok

    # ---- one step ---------------------------------------------------------------------------------
    def bitmask(self, rows) -> Optional[Tuple[List[int], torch.Tensor]]:
        """rows: the step's ScheduledRequests (each with its RequestState attached). Returns the sampled-row
        indices that have a constraint and their bitmask [R, W] int32 on the host (None when no row has one).

        A verify step's rows of one request (1 + k: one per draft position) get the masks of the grammar
        advanced through the drafts before them, then the matcher is rolled back: the tokens kept are only
        known when the step completes."""
        if not self.grammars:
            return None
        import xgrammar as xgr

        idx: List[int] = []
        masks: List[Tuple[object, List[int], Sequence[int]]] = []
        row = 0
        for r in rows:
            if not r.sample:
                continue
            st = r.request
            if st.request_id in self.grammars:
                matcher = self._matcher(st)
                if matcher is None or not self.grammars[st.request_id].active:  # (still reasoning: free)
                    row += r.num_sampled_rows
                    continue
                if st.num_inflight > 1:
                    raise RuntimeError("a request with structured outputs was launched before its last step's tokens "
                                       "were read back; the engine must wait for it")
                masks.append((matcher, self.grammars[st.request_id].stop_ids, r.spec_token_ids))
                idx.extend(range(row, row + r.num_sampled_rows))
            row += r.num_sampled_rows
        if not masks:
            return None
        bm = xgr.allocate_token_bitmask(len(idx), self.vocab_size)
        batch: List[object] = []  # plain one-row requests: filled together, on xgrammar's threads
        batch_rows: List[int] = []
        out = 0
        for matcher, stop_ids, drafts in masks:
            if not drafts and not matcher.is_terminated():
                batch.append(matcher)
                batch_rows.append(out)
                out += 1
                continue
            accepted = 0
            for j in range(1 + len(drafts)):
                if matcher.is_terminated():
                    # Past the end (a request with ignore_eos): only stop tokens, as at the grammar's end.
                    bm[out].zero_()
                    for t in stop_ids:
                        if t < self.vocab_size:
                            bm[out, t // 32] |= _bit(t % 32)
                else:
                    matcher.fill_next_token_bitmask(bm, out)
                out += 1
                if j < len(drafts) and accepted == j and not matcher.is_terminated() \
                        and matcher.accept_token(drafts[j]):
                    accepted += 1
            if accepted:
                matcher.rollback(accepted)
        if len(batch) == 1:
            batch[0].fill_next_token_bitmask(bm, batch_rows[0])
        elif batch:
            if self._batch_matcher is None:
                self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=min(8, os.cpu_count() or 1))
            self._batch_matcher.batch_fill_next_token_bitmask(batch, bm, indices=batch_rows)
        return idx, bm

    def accept(self, st, tokens: Sequence[int]) -> None:
        """The tokens request `st` kept this step (already appended to st.output_token_ids) join its matcher."""
        g = self.grammars.get(st.request_id)
        if g is None:
            return
        if g.matcher is None:
            self._matcher(st)  # replays every output, these included
            return
        if not g.active:
            outs = st.output_token_ids
            after = _find(outs, g.end, len(outs) - len(tokens) - len(g.end) + 1)
            if after < 0:
                return
            g.active = True
            tokens = outs[after:]
        for t in tokens:
            self._accept(g.matcher, st.request_id, t)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)


def _bit(i: int) -> int:
    """Bit i of an int32 word, as the signed value torch stores (bit 31 is the sign)."""
    return (1 << i) - (1 << 32) if i == 31 else (1 << i)
