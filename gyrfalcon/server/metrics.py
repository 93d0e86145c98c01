"""ServerMetrics: Prometheus metrics at /metrics, named like vLLM's with a `gyrfalcon:` prefix, or under vLLM's own
`vllm:` names (`--metrics-prefix vllm`, through VLLM_NAMES) for dashboards and routers built for vLLM.

Two sources: the engine core's stats snapshot (sent with every step and as an idle heartbeat) gives the scheduler
and cache gauges and counters and the histograms timed in the core (engine/request_stats.py: prefill / decode /
inference time, inter-token latency, tokens per request and per step); the HTTP process itself observes tokens,
finished requests and the latencies it sees (arrival, first token, finish). Counters follow prometheus naming:
`gyrfalcon:prompt_tokens` is exposed as `gyrfalcon:prompt_tokens_total`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Dict, List

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from gyrfalcon.engine.request_stats import HISTOGRAMS

logger = logging.getLogger("gyrfalcon.server")

# gyrfalcon's metric names (after "gyrfalcon:") -> vLLM's (after "vllm:"), the one place the two are matched. Where
# vLLM's meaning is the same the name is too; gyrfalcon's per-request mean time per output token is what vLLM calls
# request_time_per_output_token_seconds (vLLM's older time_per_output_token_seconds was per token: the inter-token
# latency, served under that name too as VLLM_ALIASES says). The spec_decode_* counters are counted by speculative
# decoding (issue 11); their names are here so that they map as soon as they exist.
VLLM_NAMES = {
    "num_requests_running": "num_requests_running",  # gauge
    "num_requests_waiting": "num_requests_waiting",  # gauge
    "kv_cache_usage_perc": "kv_cache_usage_perc",  # gauge, 0..1 (vLLM before V1: gpu_cache_usage_perc)
    "prefix_cache_queries": "prefix_cache_queries",  # counter, tokens
    "prefix_cache_hits": "prefix_cache_hits",  # counter, tokens
    "num_preemptions": "num_preemptions",  # counter
    "prompt_tokens": "prompt_tokens",  # counter
    "generation_tokens": "generation_tokens",  # counter
    "request_success": "request_success",  # counter, finished_reason label
    "time_to_first_token_seconds": "time_to_first_token_seconds",  # histogram
    "time_per_output_token_seconds": "request_time_per_output_token_seconds",  # histogram, per request
    "inter_token_latency_seconds": "inter_token_latency_seconds",  # histogram, per step of a request
    "e2e_request_latency_seconds": "e2e_request_latency_seconds",  # histogram
    "request_queue_time_seconds": "request_queue_time_seconds",  # histogram
    "request_prefill_time_seconds": "request_prefill_time_seconds",  # histogram
    "request_decode_time_seconds": "request_decode_time_seconds",  # histogram
    "request_inference_time_seconds": "request_inference_time_seconds",  # histogram
    "request_prompt_tokens": "request_prompt_tokens",  # histogram
    "request_generation_tokens": "request_generation_tokens",  # histogram
    "iteration_tokens_total": "iteration_tokens_total",  # histogram, tokens per engine step
    "spec_decode_num_drafts": "spec_decode_num_drafts",  # counter
    "spec_decode_num_draft_tokens": "spec_decode_num_draft_tokens",  # counter
    "spec_decode_num_accepted_tokens": "spec_decode_num_accepted_tokens",  # counter
    "spec_decode_num_accepted_tokens_per_pos": "spec_decode_num_accepted_tokens_per_pos",  # counter, position label
}
# Extra vLLM names served with --metrics-prefix vllm: vLLM name -> the gyrfalcon metric it repeats (vLLM's older
# names, which dashboards made for earlier vLLM releases still query).
VLLM_ALIASES = {"time_per_output_token_seconds": "inter_token_latency_seconds",
                "gpu_cache_usage_perc": "kv_cache_usage_perc"}
PREFIXES = ("gyrfalcon", "vllm")


def metric_name(prefix: str, name: str) -> str:
    """The exposed name of gyrfalcon's metric `name` under `prefix` ("gyrfalcon" or "vllm")."""
    if prefix == "vllm":
        return "vllm:" + VLLM_NAMES[name]
    return f"{prefix}:{name}"


_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_TPOT_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
_LATENCY_BUCKETS = [0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


class _EngineStatsCollector:
    """Exposes the latest engine-core snapshot at scrape time."""

    def __init__(self, get_stats: Callable[[], Dict], model_name: str, prefix: str) -> None:
        self.get_stats = get_stats
        self.model_name = model_name
        self.prefix = prefix

    def collect(self):
        s = self.get_stats()
        lbl = ["model_name"]
        for name, doc, key in (
                ("num_requests_running", "Requests in the running batch.", "running"),
                ("num_requests_waiting", "Requests waiting to be scheduled.", "waiting"),
                ("kv_cache_usage_perc", "KV-cache usage: 1 means all blocks are held.", "kv_usage")):
            for exposed in self._names(name):
                g = GaugeMetricFamily(exposed, doc, labels=lbl)
                g.add_metric([self.model_name], float(s.get(key, 0)))
                yield g
        for name, doc, key in (
                ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_queries"),
                ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_hits"),
                ("num_preemptions", "Preemptions of running requests.", "preemptions")):
            c = CounterMetricFamily(metric_name(self.prefix, name), doc, labels=lbl)
            c.add_metric([self.model_name], float(s.get(key, 0)))
            yield c
        hists = s.get("histograms") or {}
        for name, (bounds, doc) in HISTOGRAMS.items():
            cum, total = hists.get(name) or ([0] * (len(bounds) + 1), 0.0)
            buckets = [(_bound(b), float(c)) for b, c in zip(bounds, cum)] + [("+Inf", float(cum[-1]))]
            for exposed in self._names(name):
                h = HistogramMetricFamily(exposed, doc, labels=lbl)
                h.add_metric([self.model_name], buckets, sum_value=float(total))
                yield h

        # Speculative decoding (vLLM's spec_decode_* counters under this prefix; only when a proposer runs).
        spec = s.get("spec_decode")
        if spec is not None:
            for name, doc, key in (
                    ("spec_decode_num_drafts", "Verify steps of a request (drafts proposed once).", "num_drafts"),
                    ("spec_decode_num_draft_tokens", "Draft tokens verified.", "num_draft_tokens"),
                    ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", "num_accepted_tokens")):
                c = CounterMetricFamily(metric_name(self.prefix, name), doc, labels=lbl)
                c.add_metric([self.model_name], float(spec.get(key, 0)))
                yield c
            c = CounterMetricFamily(metric_name(self.prefix, "spec_decode_num_accepted_tokens_per_pos"),
                                    "Draft tokens accepted at each draft position (0-based).",
                                    labels=lbl + ["position"])
            for pos, n in enumerate(spec.get("accepted_per_pos", [])):
                c.add_metric([self.model_name, str(pos)], float(n))
            yield c


    def _names(self, name: str) -> List[str]:
        """The names gyrfalcon's metric `name` is exposed under: its own, and with the vllm prefix its aliases."""
        out = [metric_name(self.prefix, name)]
        if self.prefix == "vllm":
            out += ["vllm:" + alias for alias, of in VLLM_ALIASES.items() if of == name]
        return out


def _bound(b) -> str:
    return repr(float(b))


class ServerMetrics:
    def __init__(self, model_name: str, get_stats: Callable[[], Dict], prefix: str = "gyrfalcon") -> None:
        if prefix not in PREFIXES:
            raise ValueError(f"metrics prefix must be one of {list(PREFIXES)}, got {prefix!r}.")
        self.model_name = model_name
        self.get_stats = get_stats
        self.prefix = prefix
        r = self.registry = CollectorRegistry()
        lbl = ["model_name"]

        def n(name: str) -> str:
            return metric_name(prefix, name)

        self.prompt_tokens = Counter(n("prompt_tokens"), "Prefilled prompt tokens (once per request).",
                                     lbl, registry=r).labels(model_name)
        self.generation_tokens = Counter(n("generation_tokens"), "Generated tokens.", lbl,
                                         registry=r).labels(model_name)
        self._success = Counter(n("request_success"),
                                "Finished engine requests (samples) by finish reason.",
                                lbl + ["finished_reason"], registry=r)
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name, reason)
        self.ttft = Histogram(n("time_to_first_token_seconds"), "Time to first token.", lbl,
                              buckets=_TTFT_BUCKETS, registry=r).labels(model_name)
        self.tpot = Histogram(n("time_per_output_token_seconds"),
                              "Mean time per output token after the first, per sample.", lbl,
                              buckets=_TPOT_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram(n("e2e_request_latency_seconds"), "End-to-end request latency.", lbl,
                             buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.queue_time = Histogram(n("request_queue_time_seconds"),
                                    "Time a request waited in the engine before its first scheduling.",
                                    lbl, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        r.register(_EngineStatsCollector(get_stats, model_name, prefix))
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
