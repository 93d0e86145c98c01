"""RequestStats: the engine core's per-request and per-step histograms, kept where the timestamps are (as vLLM's
engine core does): prefill, decode and inference time, inter-token latency, prompt and generation tokens per
request, and tokens per step. They travel to the HTTP process inside the stats snapshot as cumulative bucket counts
(`snapshot()`), which server/metrics.py exposes as Prometheus histograms; nothing here imports prometheus.

Times are time.monotonic() seconds of the engine core's clock:
  prefill = first token - first scheduling;  decode = last token - first token;  inference = prefill + decode;
  inter-token latency = the time between two updates of one request that carried tokens (one per step: with
  speculative decoding a step may bring several tokens, as vLLM counts it).
A request is recorded once, when it ends (its finished update, a FinishRequests for a stop string the HTTP process
found, or an abort); an abort before its first token records nothing.
"""

from __future__ import annotations

import bisect
from itertools import accumulate
from typing import Dict, List, Optional, Sequence

# Bucket upper bounds (vLLM's, so dashboards' quantile queries read the same); +Inf is implied.
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

# name (after the metrics prefix) -> (buckets, help)
HISTOGRAMS = {
    "request_prefill_time_seconds": (LATENCY_BUCKETS, "Time from a request's first scheduling to its first token."),
    "request_decode_time_seconds": (LATENCY_BUCKETS, "Time from a request's first token to its last."),
    "request_inference_time_seconds": (LATENCY_BUCKETS, "Time from a request's first scheduling to its last token."),
    "inter_token_latency_seconds": (ITL_BUCKETS, "Time between two steps' tokens of one request."),
    "request_prompt_tokens": (TOKEN_BUCKETS, "Prompt tokens per finished request."),
    "request_generation_tokens": (TOKEN_BUCKETS, "Generated tokens per finished request."),
    "iteration_tokens_total": (ITERATION_BUCKETS, "Tokens per engine step (prompt chunks and decode tokens)."),
}


class _Histogram:
    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # per bucket, not cumulative; the last is (max bound, +Inf)
        self.sum = 0.0

    def observe(self, x: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, x)] += 1
        self.sum += x


class _Timing:
    __slots__ = ("scheduled", "first_token", "last_token", "num_prompt", "num_output")

    def __init__(self, num_prompt: int) -> None:
        self.scheduled: Optional[float] = None
        self.first_token: Optional[float] = None
        self.last_token: Optional[float] = None
        self.num_prompt = num_prompt
        self.num_output = 0


class RequestStats:
    def __init__(self) -> None:
        self.hist: Dict[str, _Histogram] = {name: _Histogram(b) for name, (b, _) in HISTOGRAMS.items()}
        self._live: Dict[str, _Timing] = {}
        self.version = 0  # bumped by every observation: a snapshot of an older version is stale

    def on_add(self, request_id: str, num_prompt_tokens: int) -> None:
        self._live[request_id] = _Timing(num_prompt_tokens)

    def on_step(self, num_tokens: int, updates, now: float, first_scheduled: Dict[str, Optional[float]]) -> None:
        """num_tokens: the step's scheduled tokens (0: nothing ran); updates: its RequestUpdates;
        first_scheduled: request id -> its first scheduling time, for the requests whose first update this is."""
        if num_tokens:
            self.hist["iteration_tokens_total"].observe(num_tokens)
            self.version += 1
        for u in updates:
            t = self._live.get(u.request_id)
            if t is None:
                continue
            if t.scheduled is None and first_scheduled.get(u.request_id) is not None:
                t.scheduled = first_scheduled[u.request_id]
            if u.new_token_ids:
                if t.first_token is None:
                    t.first_token = now
                else:
                    self.hist["inter_token_latency_seconds"].observe(now - t.last_token)
                t.last_token = now
                t.num_output += len(u.new_token_ids)
                self.version += 1
            if u.finished:
                self.on_end(u.request_id)

    def on_end(self, request_id: str) -> None:
        t = self._live.pop(request_id, None)
        if t is None or t.first_token is None:
            return
        h = self.hist
        self.version += 1
        h["request_prompt_tokens"].observe(t.num_prompt)
        h["request_generation_tokens"].observe(t.num_output)
        decode = t.last_token - t.first_token
        h["request_decode_time_seconds"].observe(decode)
        if t.scheduled is not None:
            prefill = max(0.0, t.first_token - t.scheduled)
            h["request_prefill_time_seconds"].observe(prefill)
            h["request_inference_time_seconds"].observe(prefill + decode)

    def snapshot(self) -> Dict[str, List]:
        """name -> [cumulative counts per bucket with +Inf last, sum] (msgpack-friendly)."""
        return {name: [list(accumulate(h.counts)), h.sum] for name, h in self.hist.items()}
