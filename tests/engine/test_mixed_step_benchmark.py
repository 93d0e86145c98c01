"""benchmarks/mixed_step.py drives the real engine through a prefill alone, a decode step and a mixed step: on
a CPU it profiles CPU ops, which checks that the steps it times are the ones it names (the mixed step holds
the decoders and the new prompts) and that it writes its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_mixed_step_benchmark_runs(tmp_path, qwen3_ckpt):
    out = tmp_path / "mixed.json"
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "mixed_step.py"), "--model", str(qwen3_ckpt),
                        "--decoders", "3", "--prompts", "2", "--input-len", "24", "--max-num-seqs", "8",
                        "--cprofile", "--output-json", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["decoders"] == 3 and res["prompts"] == 2
    steps = res["results"]
    assert [steps[k]["label"] for k in ("prefill_alone", "decode_alone", "mixed")] == [
        "prefill alone (2 x 24)", "decode alone (3 sequences)", "mixed (2 x 24 + 3 decoders)"]
    assert [(steps[k]["decode_rows"], steps[k]["prompt_tokens"]) for k in ("prefill_alone", "decode_alone", "mixed")] \
        == [(0, 48), (3, 0), (3, 48)]
    assert all(0 < steps[k]["launch_ms"] <= steps[k]["wall_ms"] for k in ("prefill_alone", "decode_alone", "mixed"))
    assert all(steps[k]["wall_ms"] > 0 and steps[k]["kernels"] > 0 for k in ("prefill_alone", "decode_alone", "mixed"))
    assert "mixed step" in r.stdout
    # --cprofile: the host's functions by own time, longest first, within the step's wall time
    for k in ("prefill_alone", "decode_alone", "mixed"):
        own = [row[2] for row in steps[k]["host_own_time"]]
        assert own and own == sorted(own, reverse=True) and 0 < sum(own) <= steps[k]["wall_ms"] * 1.05
    assert "host functions by own time" in r.stdout
