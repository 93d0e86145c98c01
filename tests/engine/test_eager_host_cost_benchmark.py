"""benchmarks/eager_host_cost.py on the CPU: an eager mixed step of a real model's shape is built and run with
the launches skipped (its own plumbing; the numbers it prints are the point of running it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_eager_host_cost_benchmark_runs(tmp_path):
    out = tmp_path / "host.json"
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "eager_host_cost.py"), "--preset", "qwen3-0.6b",
                        "--prompts", "2", "--input-len", "16", "--decoders", "3", "--context", "40", "--reps", "1",
                        "--profile", "--output-json", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())["results"]
    assert (res["tokens"], res["sequences"], res["layers"]) == (2 * 16 + 3, 5, 28)
    assert res["build_ms"] > 0 and res["forward_ms"] > 0
    assert abs(res["forward_ms_per_layer"] * 28 - res["forward_ms"]) < 1e-9
    assert "eager step of 35 tokens, 5 sequences" in r.stdout and "tottime" in r.stdout
