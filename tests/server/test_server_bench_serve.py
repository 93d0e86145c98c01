"""`gyrfalcon bench serve` against the shared server: it prints vLLM's report and saves it as JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from server_testutil import API_KEY, MODEL_NAME, REPO


def test_bench_serve(server, tmp_path):
    out = tmp_path / "serve.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "gyrfalcon.cli", "bench", "serve", "--base-url", server.base_url,
           "--model", MODEL_NAME, "--dataset", "random", "--input-len", "24", "--output-len", "8",
           "--num-prompts", "16", "--max-concurrency", "4", "--request-rate", "50", "--ignore-eos",
           "--api-key", API_KEY, "--save-result", str(out), "--disable-tqdm"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    for line in ("Successful requests:", "Failed requests:", "Benchmark duration (s):",
                 "Request throughput (req/s):", "Output token throughput (tok/s):",
                 "Total Token throughput (tok/s):", "Mean TTFT (ms):", "Median TPOT (ms):", "P99 ITL (ms):",
                 "Mean E2EL (ms):"):
        assert line in p.stdout, line
    r = json.loads(out.read_text())
    assert r["completed"] == 16 and r["failed"] == 0
    assert r["total_input_tokens"] == 16 * 24 and r["total_output_tokens"] == 16 * 8
    assert r["mean_ttft_ms"] > 0 and r["p99_e2el_ms"] >= r["median_e2el_ms"]
    server.wait_idle()


def test_bench_cli_lists_serve():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-m", "gyrfalcon.cli", "bench", "--help"], capture_output=True, text=True,
                       timeout=60, env=env)
    assert p.returncode == 0 and "serve" in p.stdout


def test_bench_serve_reports_http_errors_in_one_line(server):
    """A refused key (401), a wrong endpoint (404) and a port nobody listens on: one `error: ...` line on stderr
    naming the status and the server's message, exit status 1, no traceback."""
    from server_testutil import free_port

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    base = [sys.executable, "-m", "gyrfalcon.cli", "bench", "serve", "--model", MODEL_NAME, "--num-prompts", "2",
            "--input-len", "4", "--output-len", "2", "--disable-tqdm"]
    cases = [(["--base-url", server.base_url], "HTTP 401", "API key"),
             (["--base-url", server.base_url, "--api-key", API_KEY, "--endpoint", "/v1/nothing"], "HTTP 404",
              "Not Found"),
             (["--base-url", f"http://127.0.0.1:{free_port()}"], "cannot connect", "Connection refused")]
    for args, *needles in cases:
        p = subprocess.run([*base, *args], capture_output=True, text=True, timeout=120,
                           env={**env, "OPENAI_API_KEY": ""})
        assert p.returncode == 1, (args, p.stdout, p.stderr)
        errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and all(n in errors[0] for n in needles), (args, p.stderr)
        assert "Traceback" not in p.stdout + p.stderr, p.stderr


def _bench(server, *args, timeout=300):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "gyrfalcon.cli", "bench", "serve", "--base-url", server.base_url, "--model",
           MODEL_NAME, "--api-key", API_KEY, "--disable-tqdm", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def test_bench_serve_vllm_command_line(server, tmp_path):
    """`vllm bench serve`'s flags: --save-result as a switch with --result-dir / --result-filename, the selected
    --percentile-metrics at the --metric-percentiles, --goodput SLOs, --num-warmups, --metadata, --save-detailed."""
    p = _bench(server, "--backend", "openai", "--dataset-name", "random", "--random-input-len", "16",
               "--random-output-len", "6", "--random-range-ratio", "0.5", "--random-prefix-len", "4",
               "--num-prompts", "8", "--max-concurrency", "4", "--num-warmups", "2", "--ignore-eos",
               "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,90", "--goodput", "ttft:600000",
               "tpot:600000", "--save-result", "--save-detailed", "--result-dir", str(tmp_path / "res"),
               "--result-filename", "r.json", "--metadata", "run=ci", "gpu=none")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Warmup run completed." in p.stdout and "Request goodput (req/s):" in p.stdout
    assert "P90 ITL (ms):" in p.stdout and "E2EL" not in p.stdout
    r = json.loads((tmp_path / "res" / "r.json").read_text())
    assert r["completed"] == 8 and r["failed"] == 0 and r["num_warmups"] == 2
    assert r["request_goodput"] == r["request_throughput"] > 0  # SLOs of 10 minutes: every request meets them
    assert {"p50_ttft_ms", "p90_tpot_ms", "median_itl_ms"} <= set(r) and "mean_e2el_ms" not in r
    assert r["run"] == "ci" and r["gpu"] == "none"
    assert all(4 + 8 <= n <= 4 + 24 for n in r["input_lens"]) and len(set(r["input_lens"])) > 1
    assert all(3 <= n <= 9 for n in r["output_lens"]) and sum(r["output_lens"]) == r["total_output_tokens"]
    server.wait_idle()


def test_result_file_name_and_bad_flags():
    """--save-result alone names its file as vLLM does; flags that cannot work stop before anything connects."""
    import argparse

    from gyrfalcon.bench.serve import add_cli_args
    from gyrfalcon.bench.serve_client import check_args
    from gyrfalcon.bench.serve_report import result_path

    ap = argparse.ArgumentParser()
    add_cli_args(ap)
    args = ap.parse_args(["--save-result", "--max-concurrency", "2", "--result-dir", "out"])
    path = result_path(args, "org/My-Model")
    assert path.startswith(os.path.join("out", "openai-infqps-concurrency2-My-Model-")) and path.endswith(".json")
    args = ap.parse_args(["--save-result", "--label", "base", "--request-rate", "4", "--result-filename", "x.json"])
    assert result_path(args, "m") == os.path.join(".", "x.json")
    assert result_path(ap.parse_args(["--save-result", "f.json"]), "m") == "f.json"
    assert result_path(ap.parse_args([]), "m") is None
    aa = result_path(ap.parse_args(["--profile", "aa", "--save-result"]), "m")
    assert os.path.basename(aa).startswith("openai-aa-m-")
    for argv, needle in ((["--goodput", "ttfb:5"], "--goodput 'ttfb:5'"),
                         (["--percentile-metrics", "ttft,speed"], "--percentile-metrics"),
                         (["--metadata", "novalue"], "KEY=VALUE"),
                         (["--dataset-name", "sharegpt"], "--dataset-path"),
                         (["--profile", "aa", "--aa-workloads", "100"], "--aa-workloads"),
                         (["--profile", "aa", "--aa-concurrency", "0"], "--aa-concurrency"),
                         (["--profile"], "torch-profiler"), (["--profile", "bb"], "the one profile is aa")):
        with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
            check_args(ap.parse_args(argv))
    check_args(ap.parse_args(["--profile", "aa", "--goodput", "ttft:5", "e2el:9"]))


def test_bench_serve_sharegpt_and_prefix_repetition(server, server_ckpt, tmp_path):
    """sharegpt from a local file (its first turn the prompt, the reply's length max_tokens; too short
    conversations skipped); prefix-repetition's shared prefixes hit the server's prefix cache."""
    words = "the quick brown fox jumps over the lazy dog while seven tired wizards argue about soup".split()
    convs = [{"conversations": [{"from": "human", "value": " ".join(words[i:] + words[:i])},
                                {"from": "gpt", "value": " ".join(words[:6 + i])}]} for i in range(6)]
    convs.append({"conversations": [{"from": "human", "value": "hi"}]})  # one turn: skipped
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps(convs))
    p = _bench(server, "--dataset-name", "sharegpt", "--dataset-path", str(data), "--num-prompts", "5",
               "--max-concurrency", "3", "--ignore-eos", "--save-result", str(tmp_path / "s.json"))
    assert p.returncode == 0, p.stdout + p.stderr
    r = json.loads((tmp_path / "s.json").read_text())
    assert r["dataset_name"] == "sharegpt" and r["completed"] == 5 and r["failed"] == 0
    from transformers import AutoTokenizer

    from gyrfalcon.bench.serve_datasets import DatasetError, sharegpt_requests

    tok = AutoTokenizer.from_pretrained(str(server_ckpt))
    reqs = sharegpt_requests(tok, str(data), 6, seed=0)
    assert sorted(r.output_len for r in reqs) == sorted(len(tok(" ".join(words[:6 + i])).input_ids) for i in range(6))
    with pytest.raises(DatasetError, match="6 usable conversations"):
        sharegpt_requests(tok, str(data), 7, seed=0)

    before = server.wait_idle()
    p = _bench(server, "--dataset-name", "prefix-repetition", "--prefix-repetition-prefix-len", "32",
               "--prefix-repetition-suffix-len", "8", "--prefix-repetition-num-prefixes", "2",
               "--prefix-repetition-output-len", "3", "--num-prompts", "6", "--max-concurrency", "1", "--ignore-eos",
               "--save-result", str(tmp_path / "p.json"))
    assert p.returncode == 0, p.stdout + p.stderr
    r = json.loads((tmp_path / "p.json").read_text())
    assert r["completed"] == 6 and r["total_input_tokens"] == 6 * 40 and r["total_output_tokens"] == 6 * 3
    after = server.wait_idle()
    # One at a time: every request after the first of its prefix finds the prefix's two full blocks cached.
    assert after["gyrfalcon:prefix_cache_hits_total"] - before["gyrfalcon:prefix_cache_hits_total"] >= 4 * 32


def test_bench_serve_aa_profile(server, tmp_path):
    """--profile aa at a fiftieth of AA's lengths: every workload at each concurrency, fresh prompts, output speed
    and TTFT as P50 / P90 from the server's token counts."""
    before = server.wait_idle()
    p = _bench(server, "--profile", "aa", "--aa-scale", "0.02", "--aa-concurrency", "1,3",
               "--aa-requests-per-stream", "1", "--save-result", str(tmp_path / "aa.json"))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Artificial Analysis profile" in p.stdout and "P50 speed" in p.stdout
    r = json.loads((tmp_path / "aa.json").read_text())
    assert r["profile"] == "aa"
    got = [(x["input_len"], x["output_len"], x["max_concurrency"]) for x in r["runs"]]
    assert got == [(2, 6, 1), (2, 6, 3), (20, 20, 1), (20, 20, 3), (200, 30, 1), (200, 30, 3)]
    for x in r["runs"]:
        assert x["completed"] == x["max_concurrency"] and x["failed"] == 0
        assert x["total_output_tokens"] == x["max_concurrency"] * x["output_len"]
        assert x["total_input_tokens"] == x["max_concurrency"] * x["input_len"]
        assert 0 < x["p50_output_speed_tok_s"] <= x["p90_output_speed_tok_s"]
        assert 0 < x["p50_ttft_ms"] <= x["p90_ttft_ms"]
    after = server.wait_idle()
    # Fresh prompts: nothing of the 200-token ones (12 full blocks each) came from the prefix cache.
    assert after["gyrfalcon:prefix_cache_hits_total"] - before["gyrfalcon:prefix_cache_hits_total"] < 16 * 4


def test_spec_decode_acceptance_from_metrics_deltas(capsys):
    """Acceptance length = 1 + accepted / drafts over the run, from two /metrics readings of the spec-decode
    counters (either prefix); a server that counts none gives no section."""
    import argparse

    from gyrfalcon.bench.serve import add_cli_args
    from gyrfalcon.bench.serve_report import print_report, spec_decode_counts, spec_decode_summary, summarize

    def page(prefix, drafts, tokens, accepted, per_pos):
        lines = []
        for name, v in (("spec_decode_num_drafts", drafts), ("spec_decode_num_draft_tokens", tokens),
                        ("spec_decode_num_accepted_tokens", accepted)):
            lines += [f"# TYPE {prefix}:{name} counter", f'{prefix}:{name}_total{{model_name="m"}} {v}']
        lines.append(f"# TYPE {prefix}:spec_decode_num_accepted_tokens_per_pos counter")
        lines += [f'{prefix}:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{i}"}} {v}'
                  for i, v in enumerate(per_pos)]
        return "\n".join(lines) + "\n"

    for prefix in ("gyrfalcon", "vllm"):
        before = spec_decode_counts(page(prefix, 10, 30, 12, [8, 3, 1]))
        after = spec_decode_counts(page(prefix, 110, 330, 212, [98, 73, 41]))
        s = spec_decode_summary(before, after)
        assert s["spec_decode_num_drafts"] == 100 and s["spec_decode_draft_tokens"] == 300
        assert s["spec_decode_accepted_tokens"] == 200 and s["spec_decode_acceptance_length"] == 3.0
        assert abs(s["spec_decode_acceptance_rate"] - 200 / 3) < 1e-9
        assert s["spec_decode_per_position_acceptance_rates"] == [0.9, 0.7, 0.4]
    assert spec_decode_summary(before, before) == {}
    assert spec_decode_counts('# TYPE gyrfalcon:prompt_tokens counter\ngyrfalcon:prompt_tokens_total 5\n') == {}

    ap = argparse.ArgumentParser()
    add_cli_args(ap)
    m = {**summarize([], 1.0, [99.0]), **s}
    print_report(m, ap.parse_args([]), [99.0])
    out = capsys.readouterr().out
    assert "Speculative Decoding" in out and "Acceptance length:" in out and "3.00" in out
    print_report(summarize([], 1.0, [99.0]), ap.parse_args([]), [99.0])
    assert "Speculative Decoding" not in capsys.readouterr().out
