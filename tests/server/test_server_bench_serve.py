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
