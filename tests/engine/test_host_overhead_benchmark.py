"""benchmarks/host_overhead.py runs the real engine with a stand-in runner: a short run must work and
write its JSON (so the benchmark cannot rot while the engine changes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_host_overhead_benchmark_runs(tmp_path):
    out = tmp_path / "host.json"
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "host_overhead.py"), "--steps", "5",
                        "--batch-sizes", "1", "3", "--output-json", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(out.read_text())["results"]
    steps = [row for row in rows if "us_per_step" in row]
    assert len(steps) == 2 * 2 * 2 and all(row["us_per_step"] > 0 for row in steps)
    # the admission timing: one row per batch size, 128-token prompts by default
    adm = [row for row in rows if "admission_us" in row]
    assert [row["batch"] for row in adm] == [1, 3] and all(row["admission_us"] > 0 for row in adm)
    assert all(row["admission_len"] == 128 for row in adm)
