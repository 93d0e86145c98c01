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
    assert len(rows) == 2 * 2 * 2 and all(row["us_per_step"] > 0 for row in rows)
