"""Speculative decoding's counters: SpecDecodingStats, the server's /metrics exposition, and the mean acceptance
length that bench latency and bench serve report."""

from __future__ import annotations

from prometheus_client import generate_latest

from gyrfalcon.bench.serve_report import spec_decode_counts
from gyrfalcon.engine.spec_stats import SpecDecodingStats, spec_decode_summary
from gyrfalcon.server.metrics import ServerMetrics


def test_stats_count_drafts_and_positions():
    s = SpecDecodingStats()
    s.observe(3, 2)
    s.observe(3, 0)
    s.observe(2, 2)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (3, 8, 4)
    assert s.accepted_per_pos == [2, 2, 0]
    assert s.mean_acceptance_length == 1 + 4 / 3
    assert SpecDecodingStats().mean_acceptance_length == 1.0


def test_server_exports_spec_counters_with_positions():
    s = SpecDecodingStats()
    s.observe(3, 2)
    s.observe(3, 1)
    stats = {"running": 1, "spec_decode": s.as_dict()}
    text = generate_latest(ServerMetrics("m", lambda: stats).registry).decode()
    assert 'gyrfalcon:spec_decode_num_drafts_total{model_name="m"} 2.0' in text
    assert 'gyrfalcon:spec_decode_num_draft_tokens_total{model_name="m"} 6.0' in text
    assert 'gyrfalcon:spec_decode_num_accepted_tokens_total{model_name="m"} 3.0' in text
    assert 'gyrfalcon:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 2.0' in text
    assert 'gyrfalcon:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 1.0' in text
    assert 'position="2"} 0.0' in text
    # Without a proposer the engine core sends no spec_decode entry, and none is exported.
    text = generate_latest(ServerMetrics("m", lambda: {"running": 1}).registry).decode()
    assert "spec_decode" not in text


def test_bench_serve_reads_the_counters_from_metrics_text():
    """bench serve's parser reads what the server exposes, under gyrfalcon's names or vLLM's."""
    s = SpecDecodingStats()
    s.observe(3, 2)
    s.observe(3, 3)
    text = generate_latest(ServerMetrics("m", lambda: {"spec_decode": s.as_dict()}).registry).decode()
    want = {"drafts": 2.0, "draft_tokens": 6.0, "accepted_tokens": 5.0, "per_pos": {0: 2.0, 1: 2.0, 2: 1.0}}
    assert spec_decode_counts(text) == want
    assert spec_decode_counts(text.replace("gyrfalcon:", "vllm:")) == want
    assert spec_decode_counts(generate_latest(ServerMetrics("m", lambda: {}).registry).decode()) == {}


def test_bench_summary_is_over_the_timed_runs_only():
    before = {"num_drafts": 10, "num_draft_tokens": 30, "num_accepted_tokens": 12, "accepted_per_pos": [8, 4]}
    after = {"num_drafts": 20, "num_draft_tokens": 60, "num_accepted_tokens": 27, "accepted_per_pos": [16, 9, 2]}
    sd = spec_decode_summary(before, after)
    assert sd["num_drafts"] == 10 and sd["mean_acceptance_length"] == 1 + 15 / 10
    assert sd["acceptance_rate"] == 15 / 30
    assert sd["acceptance_per_pos"] == [0.8, 0.5, 0.2]
    assert spec_decode_summary(before, before) is None


def test_bench_latency_reports_mean_acceptance_length(qwen3_ckpt, tmp_path, capsys):
    import json

    from gyrfalcon.cli import main

    out = tmp_path / "lat.json"
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}'
    assert main(["bench", "latency", "--model", str(qwen3_ckpt), "--batch-size", "2", "--input-len", "8",
                 "--output-len", "32", "--num-iters", "2", "--num-iters-warmup", "1", "--max-model-len", "64",
                 "--speculative-config", spec, "--output-json", str(out)]) == 0
    sd = json.loads(out.read_text())["results"]["gyrfalcon"]["spec_decode"]
    assert sd["num_drafts"] > 0 and sd["mean_acceptance_length"] == 1 + sd["num_accepted_tokens"] / sd["num_drafts"]
    assert len(sd["acceptance_per_pos"]) <= 3
    assert f"mean acceptance length {sd['mean_acceptance_length']:.2f}" in capsys.readouterr().out
