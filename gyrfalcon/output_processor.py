"""OutputProcessor: the front end's view of requests: token ids from the engine -> text and outputs.

It fans a request with n > 1 out into n engine requests (children "i_<id>", seeds seed + i, so they
share the prompt's cached blocks yet sample independently), detokenizes incrementally, applies stop
strings (which need text, so they live here and not in the engine), gathers logprobs, and builds
vLLM-shaped RequestOutputs. Both the offline LLM and the HTTP server use it.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Tuple

from gyrfalcon.detokenizer import IncrementalDetokenizer, finish_all
from gyrfalcon.outputs import CompletionOutput, Logprob, RequestOutput
from gyrfalcon.sampling_params import SamplingParams


def logprob_entry(tokenizer, token_id: int, entry: tuple) -> Dict[int, Logprob]:
    """(logprob, rank, [(token, logprob)] top-N) -> {token_id: Logprob, ...top-N}, the given token first
    (as vLLM orders them)."""
    lp, rank, top = entry
    d: Dict[int, Logprob] = {}
    for r, (tid, tlp) in enumerate(top, start=1):
        d[tid] = Logprob(tlp, r, tokenizer.decode([tid]))
    if token_id not in d:
        d[token_id] = Logprob(lp, rank, tokenizer.decode([token_id]))
    else:
        d[token_id].rank = rank
    return {token_id: d.pop(token_id), **d}


class SampleState:
    """One of a request's n samples."""

    def __init__(self, engine_id: str, index: int, params: SamplingParams, prompt_token_ids: List[int],
                 tokenizer, defer_text: bool = False) -> None:
        self.engine_id = engine_id
        self.index = index
        self.params = params
        self.tokenizer = tokenizer
        self.token_ids: List[int] = []
        self.logprobs: Optional[List[Dict[int, Logprob]]] = [] if params.logprobs is not None else None
        self.cumulative_logprob: Optional[float] = 0.0 if params.logprobs is not None else None
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
        self.text = ""
        self.finish_reason: Optional[str] = None
        self.stop_reason = None
        self.max_stop_len = max((len(s) for s in params.stop), default=0)
        # Nobody reads the text before the end (offline, no stop strings): decode once at the end.
        self.defer_text = defer_text and not params.stop
        self._pending: List[int] = []
        self.final_text_pending = False  # deferred: finished, its text not decoded yet (see finish_texts)
        # What a streaming consumer has already been given.
        self.sent_text = 0
        self.sent_tokens = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _logprob_entry(self, token_id: int, entry: tuple) -> Dict[int, Logprob]:
        return logprob_entry(self.tokenizer, token_id, entry)

    def update(self, token_ids: List[int], logprobs: List[tuple], finish_reason: Optional[str],
               stop_reason) -> bool:
        """Apply one engine update; True when a stop string ended the sample here.

        A sample already finished (a stop string seen by the front end) ignores tokens that the
        engine produced before it learned of the stop (possible when they run in two processes)."""
        if self.finished:
            return False
        for j, tid in enumerate(token_ids):
            self.token_ids.append(tid)
            if self.logprobs is not None and j < len(logprobs):
                self.logprobs.append(self._logprob_entry(tid, logprobs[j]))
                self.cumulative_logprob += logprobs[j][0]
            last = j == len(token_ids) - 1
            # An eos / stop token ends the sample without adding its text (vLLM's rule).
            stop_token = last and finish_reason == "stop" and not self.params.include_stop_str_in_output
            prev_len = len(self.detok.output_text)
            if self.defer_text:
                if not stop_token:
                    self._pending.append(tid)
                if last and finish_reason is not None:
                    # decoded with the step's other finished samples (OutputProcessor.process: finish_all)
                    self.detok.extend(self._pending)
                    self._pending = []
                    self.final_text_pending = True
                continue
            if not stop_token:
                self.detok.add_token(tid)
            if last and finish_reason is not None:
                self.detok.flush()
            self.text = self.detok.output_text
            if self.params.stop and len(self.token_ids) >= self.params.min_tokens and self._check_stop_strings(prev_len):
                return True
        if finish_reason is not None:
            self.finish_reason, self.stop_reason = finish_reason, stop_reason
        return False

    def _check_stop_strings(self, prev_len: int) -> bool:
        # Only a match that ends in the new characters is new; it starts at most len(stop) - 1
        # characters before them.
        start = max(0, prev_len - self.max_stop_len + 1)
        text = self.detok.output_text
        best = None
        for s in self.params.stop:
            i = text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        self.text = text[: i + len(s)] if self.params.include_stop_str_in_output else text[:i]
        self.finish_reason, self.stop_reason = "stop", s
        return True

    def visible_text(self) -> str:
        """Text safe to show now: while running, hold back what could still become a stop string."""
        if self.finished or self.max_stop_len == 0:
            return self.text
        return self.text[: max(len(self.text) - (self.max_stop_len - 1), self.sent_text)]

    def completion_output(self) -> CompletionOutput:
        return CompletionOutput(index=self.index, text=self.visible_text(), token_ids=list(self.token_ids),
                                cumulative_logprob=self.cumulative_logprob,
                                logprobs=list(self.logprobs) if self.logprobs is not None else None,
                                finish_reason=self.finish_reason, stop_reason=self.stop_reason)

    def take_delta(self) -> Tuple[str, List[int], Optional[List[Dict[int, Logprob]]]]:
        """What a stream has not sent yet: (text, token ids, logprobs)."""
        text = self.visible_text()
        delta = text[self.sent_text:]
        self.sent_text = len(text)
        toks = self.token_ids[self.sent_tokens:]
        lps = self.logprobs[self.sent_tokens:] if self.logprobs is not None else None
        self.sent_tokens = len(self.token_ids)
        return delta, toks, lps


class RequestState:
    def __init__(self, request_id: str, prompt: Optional[str], prompt_token_ids: List[int],
                 params: SamplingParams, tokenizer, arrival_time: float, defer_text: bool = False) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.arrival_time = arrival_time
        self.first_token_time: Optional[float] = None
        self.num_cached_tokens = 0
        self.tokenizer = tokenizer
        self.prompt_logprobs: Optional[list] = [None] if params.prompt_logprobs is not None else None
        if params.n == 1:
            self.samples = [SampleState(request_id, 0, params, prompt_token_ids, tokenizer, defer_text)]
        else:
            self.samples = [SampleState(f"{i}_{request_id}", i, params.child(i), prompt_token_ids, tokenizer,
                                        defer_text) for i in range(params.n)]

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    def add_prompt_logprobs(self, first: int, entries: List[tuple]) -> None:
        """Entries for prompt tokens first, first + 1, ... (they arrive in order, chunk by chunk)."""
        if self.prompt_logprobs is None or first != len(self.prompt_logprobs):
            return
        for j, entry in enumerate(entries):
            self.prompt_logprobs.append(logprob_entry(self.tokenizer, self.prompt_token_ids[first + j], entry))

    def request_output(self) -> RequestOutput:
        return RequestOutput(request_id=self.request_id, prompt=self.prompt,
                             prompt_token_ids=self.prompt_token_ids,
                             outputs=[s.completion_output() for s in self.samples],
                             finished=self.finished, num_cached_tokens=self.num_cached_tokens,
                             prompt_logprobs=list(self.prompt_logprobs) if self.prompt_logprobs is not None
                             else None)


def finish_texts(samples: List[SampleState]) -> None:
    """Decode the text of the deferred samples that finished, all in one batch (detokenizer.finish_all)."""
    done = [s for s in samples if s.final_text_pending]
    if done:
        finish_all([s.detok for s in done])
        for s in done:
            s.text = s.detok.output_text
            s.final_text_pending = False


class OutputProcessor:
    def __init__(self, tokenizer, defer_text: bool = False) -> None:
        """defer_text=True: outputs are read only when finished (offline generate), so text without
        stop strings is decoded once at the end instead of token by token."""
        self.tokenizer = tokenizer
        self.defer_text = defer_text
        self.requests: Dict[str, RequestState] = {}
        self._by_engine_id: Dict[str, Tuple[RequestState, SampleState]] = {}

    def add_request(self, request_id: str, prompt: Optional[str], prompt_token_ids: List[int],
                    params: SamplingParams, arrival_time: Optional[float] = None
                    ) -> List[Tuple[str, SamplingParams]]:
        """Track a request; returns the (engine request id, params) pairs to hand the engine."""
        if request_id in self.requests:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        st = RequestState(request_id, prompt, prompt_token_ids, params, self.tokenizer,
                          arrival_time if arrival_time is not None else time.monotonic(), self.defer_text)
        self.requests[request_id] = st
        for s in st.samples:
            self._by_engine_id[s.engine_id] = (st, s)
        return [(s.engine_id, s.params) for s in st.samples]

    def abort(self, request_id: str) -> List[str]:
        """Forget a request; returns the engine ids still running, for the engine to abort."""
        st = self.requests.pop(request_id, None)
        if st is None:
            return []
        ids = []
        for s in st.samples:
            self._by_engine_id.pop(s.engine_id, None)
            if not s.finished:
                s.finish_reason = "abort"
                ids.append(s.engine_id)
        return ids

    def process(self, updates) -> Tuple[List[RequestState], List[str]]:
        """Apply engine updates. Returns (requests touched, in order; engine ids that a stop string
        finished and the engine must stop). Finished requests are no longer tracked afterwards."""
        touched: Dict[str, RequestState] = {}
        to_finish: List[str] = []
        now = time.monotonic()
        for u in updates:
            pair = self._by_engine_id.get(u.request_id)
            if pair is None:
                continue  # aborted in the meantime
            st, s = pair
            if u.prompt_logprobs:
                st.add_prompt_logprobs(*u.prompt_logprobs)
            if not u.new_token_ids and not u.finished:
                continue  # prompt logprobs only: no token yet, nothing for a stream to send
            if st.first_token_time is None:
                st.first_token_time = now
                st.num_cached_tokens = u.num_cached_tokens
            if s.update(u.new_token_ids, u.new_logprobs, u.finish_reason if u.finished else None,
                        u.stop_reason):
                if not u.finished:
                    to_finish.append(u.request_id)
            touched[st.request_id] = st
        finish_texts([s for st in touched.values() for s in st.samples])
        for rid, st in touched.items():
            if st.finished:
                self.requests.pop(rid, None)
                for s in st.samples:
                    self._by_engine_id.pop(s.engine_id, None)
        return list(touched.values()), to_finish
