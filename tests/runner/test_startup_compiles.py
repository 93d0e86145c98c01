"""benchmarks/startup_compiles.py: the census of the Triton kernel variants a GPU startup compiles, taken on
the CPU through the runners' own warm-up steps. Each variant is a compile (and, on the GPU machine's Triton
3.6, a launcher build) in a cold start, so the count is held to a budget here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# 33 with the defaults of 2026-12-01, for Qwen3-0.6B and Llama-3.1-8B alike, at 64 or 384 sequences: 5 in the
# activation profile, 24 in the decode ladder (13 of them batch 1's, captured with and without PDL), 2 + 2 in
# the one-split and prefill ladders.
# A change that adds variants per batch size would multiply this: raise it only knowingly.
VARIANT_BUDGET = 36


def test_startup_census(tmp_path):
    out = tmp_path / "census.json"
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "startup_compiles.py"), "--preset", "qwen3-0.6b",
                        "--max-num-seqs", "64", "--output-json", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    variants = res["variants"]
    assert res["total_variants"] == len(variants) == sum(res["by_phase"].values()) == sum(res["by_kernel"].values())
    assert set(res["by_phase"]) == {"activation profile prefill", "decode graphs", "one-split decode graphs",
                                    "prefill graphs"}
    # Every decode-step kernel is there; the prefill's own kernels come from the activation profile.
    kernels = set(res["by_kernel"])
    assert {"_norm_gemv_kernel", "_decode_split_kernel", "_embedding_with_pending_kernel"} <= kernels
    # (folded norms, the default: the prefill's SiLU-and-mul scales its rows by rstd, and only the final norm runs)
    assert {"_paged_prefill_kernel", "_qkv_prep_kernel", "_silu_and_mul_scaled_kernel", "_rms_norm_kernel"} <= kernels
    # Batch 1 is captured with and without PDL: its four GEMVs (the first layer's qkv has no residual) twice.
    assert res["new_at"]["decode graphs"]["1"] >= 10
    assert len(variants) <= VARIANT_BUDGET, r.stdout
    assert f"{len(variants)} Triton kernel variants to compile" in r.stdout


def test_precompile_compiles_exactly_the_census_variants_for_sm90(tmp_path):
    """--compile-threads: runner/precompile.py compiles the same startup steps for sm_90 for real (a fake device,
    an empty Triton cache, two threads); it compiles as many kernels as the census counted variants, and
    hands each to the launcher builder."""
    out = tmp_path / "census.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "startup_compiles.py"), "--preset", "qwen3-0.6b",
                        "--max-num-seqs", "16", "--compile-threads", "2", "--output-json", str(out)],
                       capture_output=True, text=True, timeout=900, cwd=REPO, env={**env, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    (c,) = res["compile"]
    assert c["threads"] == 2 and c["kernels"] == res["total_variants"] == c["launchers"]
    assert c["seconds"] >= c["compile_s"] > 0
