"""benchmarks/prefill_gemm_m.py on the CPU: the plumbing (each layer GEMM timed at each M, the layer's sum and
rate, odd M compared with the round M above it, the rounds in alternating order, the JSON); the rates that
matter are the GPU's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_prefill_gemm_m_benchmark_runs(tmp_path):
    out = tmp_path / "gemm_m.json"
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "prefill_gemm_m.py"), "--preset", "qwen3-0.6b",
                        "--ms", "100", "128", "256", "--reps", "2", "--rounds", "3", "--output-json", str(out), "--blas", "default", "cublaslt"],
                       capture_output=True, text=True, timeout=600, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    # Qwen3-0.6B: hidden 1024, 16 x 128 query heads, 8 x 128 kv heads, intermediate 3072.
    assert res["gemms"] == {"qkv": [1024, 4096], "o_proj": [2048, 1024], "gate_up": [1024, 6144],
                            "down": [3072, 1024]}
    # Each M once per back end (on a CPU the back end is only a label).
    assert sorted((row["M"], row["blas"]) for row in res["results"]) == [
        (m, b) for m in (100, 128, 256) for b in ("cublaslt", "default")]
    rows = {row["M"]: row for row in res["results"] if row["blas"] == "default"}
    for row in rows.values():
        assert set(row["ms"]) == {"qkv", "o_proj", "gate_up", "down"} and all(v > 0 for v in row["ms"].values())
        assert abs(row["layer_ms"] - sum(row["ms"].values())) < 1e-9
        assert len(row["round_layer_ms"]) == 3 and all(x > 0 for x in row["round_layer_ms"])  # one per round
    # Each M against the next multiple of 128 / 256 where that was measured too (not against itself).
    assert rows[100]["padded_to_128_ms"] == rows[128]["layer_ms"]
    assert rows[100]["padded_to_256_ms"] == rows[128]["padded_to_256_ms"] == rows[256]["layer_ms"]
    assert "padded_to_128_ms" not in rows[128] and not any(k.startswith("padded") for k in rows[256])
    assert "M    100  default: layer GEMMs" in r.stdout and "M    256 cublaslt: layer GEMMs" in r.stdout
