"""/metrics parses with prometheus-client's parser, has vLLM's metric names under `gyrfalcon:`, and its
counters move exactly with the traffic sent."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from server_testutil import MODEL_NAME

EXPECTED = {
    "gyrfalcon:num_requests_running": "gauge", "gyrfalcon:num_requests_waiting": "gauge",
    "gyrfalcon:kv_cache_usage_perc": "gauge", "gyrfalcon:prefix_cache_queries": "counter",
    "gyrfalcon:prefix_cache_hits": "counter", "gyrfalcon:num_preemptions": "counter",
    "gyrfalcon:prompt_tokens": "counter", "gyrfalcon:generation_tokens": "counter",
    "gyrfalcon:request_success": "counter", "gyrfalcon:time_to_first_token_seconds": "histogram",
    "gyrfalcon:time_per_output_token_seconds": "histogram", "gyrfalcon:e2e_request_latency_seconds": "histogram",
    "gyrfalcon:request_queue_time_seconds": "histogram", "gyrfalcon:inter_token_latency_seconds": "histogram",
    "gyrfalcon:request_prefill_time_seconds": "histogram", "gyrfalcon:request_decode_time_seconds": "histogram",
    "gyrfalcon:request_inference_time_seconds": "histogram", "gyrfalcon:request_prompt_tokens": "histogram",
    "gyrfalcon:request_generation_tokens": "histogram", "gyrfalcon:iteration_tokens_total": "histogram",
}


def test_metrics_format(server):
    r = httpx.get(server.base_url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name, kind in EXPECTED.items():
        assert name in families, name
        assert families[name].type == kind, (name, families[name].type)
        assert all(s.labels.get("model_name") == MODEL_NAME for s in families[name].samples)


def test_counters_match_traffic(server):
    before = server.wait_idle()
    c = server.client()
    prompt_tokens = completion_tokens = cached_tokens = 0
    # 6 completions (2 streamed), 3 chats (1 streamed), all running to max_tokens; the same long prompt
    # twice in a row, so the second finds its full blocks in the prefix cache.
    long_prompt = "def f(x):\n    return x * 2\n" * 8
    jobs = [("cmpl", long_prompt, 5, False), ("cmpl", long_prompt, 5, False), ("cmpl", "abc", 3, False),
            ("cmpl", "hello world", 7, True), ("cmpl", "x = 1", 1, True), ("cmpl", "for i in", 4, False),
            ("chat", "hi", 6, False), ("chat", "sort a list", 2, True), ("chat", "bye", 9, False)]
    for kind, text, max_tokens, stream in jobs:
        opts = {"include_usage": True} if stream else None
        if kind == "cmpl":
            r = c.completions.create(model=MODEL_NAME, prompt=text, max_tokens=max_tokens, stream=stream,
                                     stream_options=opts, extra_body={"ignore_eos": True})
        else:
            r = c.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": text}],
                                          max_tokens=max_tokens, stream=stream, stream_options=opts,
                                          extra_body={"ignore_eos": True})
        usage = [ch for ch in r][-1].usage if stream else r.usage
        assert usage.completion_tokens == max_tokens
        prompt_tokens += usage.prompt_tokens
        completion_tokens += usage.completion_tokens
        cached_tokens += usage.prompt_tokens_details.cached_tokens
    after = server.wait_idle()

    def delta(key):
        return after[key] - before.get(key, 0.0)

    assert delta("gyrfalcon:prompt_tokens_total") == prompt_tokens
    assert delta("gyrfalcon:generation_tokens_total") == completion_tokens
    assert delta("gyrfalcon:request_success_total{finished_reason=length}") == len(jobs)
    assert delta("gyrfalcon:request_success_total{finished_reason=stop}") == 0
    assert delta("gyrfalcon:request_success_total{finished_reason=abort}") == 0
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert delta(f"gyrfalcon:{h}_count") == len(jobs), h
        assert delta(f"gyrfalcon:{h}_sum") >= 0
    for h in ("request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
              "request_prompt_tokens", "request_generation_tokens"):
        assert delta(f"gyrfalcon:{h}_count") == len(jobs), h
    assert delta("gyrfalcon:request_prompt_tokens_sum") == prompt_tokens
    assert delta("gyrfalcon:request_generation_tokens_sum") == completion_tokens
    assert delta("gyrfalcon:inter_token_latency_seconds_count") == completion_tokens - len(jobs)
    # Each step's tokens: the prompts less their cached blocks, and every generated token but the last.
    assert (delta("gyrfalcon:iteration_tokens_total_sum")
            == prompt_tokens - cached_tokens + completion_tokens - len(jobs))
    # TPOT is per sample with more than one token (the max_tokens=1 job has none).
    assert delta("gyrfalcon:time_per_output_token_seconds_count") == len(jobs) - 1
    assert delta("gyrfalcon:prefix_cache_queries_total") == prompt_tokens
    assert delta("gyrfalcon:prefix_cache_hits_total") == cached_tokens >= 16
    assert after["gyrfalcon:num_requests_running"] == 0 and after["gyrfalcon:num_requests_waiting"] == 0
    assert after["gyrfalcon:kv_cache_usage_perc"] == 0.0


def test_periodic_stats_log_line(server):
    """The tests start servers with GYRFALCON_LOG_STATS_INTERVAL=2."""
    server.client().completions.create(model=MODEL_NAME, prompt="log me", max_tokens=4)
    deadline = time.monotonic() + 8
    while "Avg generation throughput" not in server.log():
        assert time.monotonic() < deadline, server.log()[-2000:]
        time.sleep(0.2)
    line = [ln for ln in server.log().splitlines() if "Avg generation throughput" in ln][-1]
    for part in ("Avg prompt throughput", "Running:", "Waiting:", "KV cache usage:", "Prefix cache hit rate:"):
        assert part in line


def test_engine_core_histograms_by_hand():
    """engine/request_stats.py on scripted steps: prefill = first token - first scheduling, decode = last token -
    first token, one inter-token gap per later step with tokens, tokens per step; a request stopped by the HTTP
    side (FinishRequests) is recorded when it ends, one aborted before its first token is not; the snapshot's
    buckets are cumulative with +Inf last, and the collector exposes them under both prefixes."""
    from types import SimpleNamespace as U

    import pytest
    from prometheus_client import generate_latest

    from gyrfalcon.engine.request_stats import HISTOGRAMS, RequestStats
    from gyrfalcon.server.metrics import ServerMetrics

    rs = RequestStats()
    rs.on_add("a", 7)
    rs.on_add("b", 3)
    rs.on_add("c", 5)
    rs.on_step(10, [U(request_id="a", new_token_ids=[1], finished=False)], 10.0, {"a": 9.5})
    rs.on_step(2, [U(request_id="a", new_token_ids=[2, 3], finished=False),
                   U(request_id="b", new_token_ids=[4], finished=False)], 10.25, {"b": 9.8})
    rs.on_step(2, [U(request_id="a", new_token_ids=[5], finished=True),
                   U(request_id="b", new_token_ids=[6], finished=False)], 11.0, {})
    rs.on_end("b")  # a stop string found by the HTTP process
    rs.on_end("c")  # aborted while waiting
    rs.on_step(0, [], 12.0, {})  # an idle step schedules nothing
    snap = rs.snapshot()

    def count_sum(name):
        cum, total = snap[name]
        assert cum == sorted(cum) and len(cum) == len(HISTOGRAMS[name][0]) + 1
        return cum[-1], pytest.approx(total)

    assert count_sum("request_prefill_time_seconds") == (2, 0.5 + 0.45)
    assert count_sum("request_decode_time_seconds") == (2, 1.0 + 0.75)
    assert count_sum("request_inference_time_seconds") == (2, 1.5 + 1.2)
    assert count_sum("inter_token_latency_seconds") == (3, 0.25 + 0.75 + 0.75)
    assert count_sum("request_prompt_tokens") == (2, 10)
    assert count_sum("request_generation_tokens") == (2, 4 + 2)
    assert count_sum("iteration_tokens_total") == (3, 14)
    cum, _ = snap["iteration_tokens_total"]
    assert cum[0] == 0 and cum[1] == 2  # le=1: none; le=8: the two 2-token steps
    assert rs._live == {}
    for prefix in ("gyrfalcon", "vllm"):
        text = generate_latest(ServerMetrics("m", lambda: {"histograms": snap}, prefix=prefix).registry).decode()
        assert f'{prefix}:iteration_tokens_total_bucket{{le="8.0",model_name="m"}} 2.0' in text
        assert f'{prefix}:request_decode_time_seconds_sum{{model_name="m"}} 1.75' in text
