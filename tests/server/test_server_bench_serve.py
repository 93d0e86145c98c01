"""`gyrfalcon bench serve` against the shared server: it prints vLLM's report and saves it as JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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
