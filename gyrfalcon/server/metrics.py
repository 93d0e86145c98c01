"""ServerMetrics: Prometheus metrics at /metrics, named like vLLM's with a `gyrfalcon:` prefix.

Two sources: the engine core's stats snapshot (sent with every step and as an idle heartbeat) gives
the scheduler and cache gauges and counters; the HTTP process itself observes tokens, finished
requests and latencies (it sees arrival, first token and finish). Counters follow prometheus naming:
`gyrfalcon:prompt_tokens` is exposed as `gyrfalcon:prompt_tokens_total`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Dict

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

logger = logging.getLogger("gyrfalcon.server")

_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_TPOT_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
_LATENCY_BUCKETS = [0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


class _EngineStatsCollector:
    """Exposes the latest engine-core snapshot at scrape time."""

    def __init__(self, get_stats: Callable[[], Dict], model_name: str) -> None:
        self.get_stats = get_stats
        self.model_name = model_name

    def collect(self):
        s = self.get_stats()
        lbl = ["model_name"]
        for name, doc, key in (
                ("gyrfalcon:num_requests_running", "Requests in the running batch.", "running"),
                ("gyrfalcon:num_requests_waiting", "Requests waiting to be scheduled.", "waiting"),
                ("gyrfalcon:kv_cache_usage_perc", "KV-cache usage: 1 means all blocks are held.", "kv_usage")):
            g = GaugeMetricFamily(name, doc, labels=lbl)
            g.add_metric([self.model_name], float(s.get(key, 0)))
            yield g
        for name, doc, key in (
                ("gyrfalcon:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                 "prefix_queries"),
                ("gyrfalcon:prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_hits"),
                ("gyrfalcon:num_preemptions", "Preemptions of running requests.", "preemptions")):
            c = CounterMetricFamily(name, doc, labels=lbl)
            c.add_metric([self.model_name], float(s.get(key, 0)))
            yield c
        # Speculative decoding (vLLM's spec_decode_* counters under this prefix; only when a proposer runs).
        spec = s.get("spec_decode")
        if spec is not None:
            for name, doc, key in (
                    ("gyrfalcon:spec_decode_num_drafts", "Verify steps of a request (drafts proposed once).",
                     "num_drafts"),
                    ("gyrfalcon:spec_decode_num_draft_tokens", "Draft tokens verified.", "num_draft_tokens"),
                    ("gyrfalcon:spec_decode_num_accepted_tokens", "Draft tokens accepted.", "num_accepted_tokens")):
                c = CounterMetricFamily(name, doc, labels=lbl)
                c.add_metric([self.model_name], float(spec.get(key, 0)))
                yield c
            c = CounterMetricFamily("gyrfalcon:spec_decode_num_accepted_tokens_per_pos",
                                    "Draft tokens accepted at each draft position (0-based).",
                                    labels=lbl + ["position"])
            for pos, n in enumerate(spec.get("accepted_per_pos", [])):
                c.add_metric([self.model_name, str(pos)], float(n))
            yield c


class ServerMetrics:
    def __init__(self, model_name: str, get_stats: Callable[[], Dict]) -> None:
        self.model_name = model_name
        self.get_stats = get_stats
        r = self.registry = CollectorRegistry()
        lbl = ["model_name"]
        self.prompt_tokens = Counter("gyrfalcon:prompt_tokens", "Prefilled prompt tokens (once per request).",
                                     lbl, registry=r).labels(model_name)
        self.generation_tokens = Counter("gyrfalcon:generation_tokens", "Generated tokens.", lbl,
                                         registry=r).labels(model_name)
        self._success = Counter("gyrfalcon:request_success",
                                "Finished engine requests (samples) by finish reason.",
                                lbl + ["finished_reason"], registry=r)
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name, reason)
        self.ttft = Histogram("gyrfalcon:time_to_first_token_seconds", "Time to first token.", lbl,
                              buckets=_TTFT_BUCKETS, registry=r).labels(model_name)
        self.tpot = Histogram("gyrfalcon:time_per_output_token_seconds",
                              "Mean time per output token after the first, per sample.", lbl,
                              buckets=_TPOT_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("gyrfalcon:e2e_request_latency_seconds", "End-to-end request latency.", lbl,
                             buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.queue_time = Histogram("gyrfalcon:request_queue_time_seconds",
                                    "Time a request waited in the engine before its first scheduling.",
                                    lbl, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        r.register(_EngineStatsCollector(get_stats, model_name))
        self._num_prompt = 0
        self._num_gen = 0

    # ---- observations (called by AsyncEngineClient) -----------------------------------------------
    def observe_queue_time(self, seconds: float) -> None:
        self.queue_time.observe(max(0.0, seconds))

    def add_generation_tokens(self, n: int) -> None:
        if n:
            self.generation_tokens.inc(n)
            self._num_gen += n

    def on_first_token(self, st) -> None:
        n = len(st.prompt_token_ids)
        self.prompt_tokens.inc(n)
        self._num_prompt += n
        if st.first_token_time is not None:
            self.ttft.observe(max(0.0, st.first_token_time - st.arrival_time))

    def on_sample_finished(self, st, s) -> None:
        self._success.labels(self.model_name, s.finish_reason or "abort").inc()
        if s.finish_reason != "abort" and st.first_token_time is not None and len(s.token_ids) > 1:
            self.tpot.observe((time.monotonic() - st.first_token_time) / (len(s.token_ids) - 1))

    def on_request_finished(self, st) -> None:
        self.e2e.observe(max(0.0, time.monotonic() - st.arrival_time))

    # ---- the periodic log line --------------------------------------------------------------------
    async def log_loop(self, interval: float) -> None:
        last_t, last_p, last_g = time.monotonic(), self._num_prompt, self._num_gen
        idle_logged = False
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            s = self.get_stats()
            dp, dg = self._num_prompt - last_p, self._num_gen - last_g
            busy = dp or dg or s.get("running") or s.get("waiting")
            if busy or not idle_logged:
                q, h = s.get("prefix_queries", 0), s.get("prefix_hits", 0)
                logger.info(
                    "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                    "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                    dp / (now - last_t), dg / (now - last_t), s.get("running", 0), s.get("waiting", 0),
                    100 * s.get("kv_usage", 0.0), 100 * h / q if q else 0.0)
                idle_logged = not busy
            last_t, last_p, last_g = now, self._num_prompt, self._num_gen
