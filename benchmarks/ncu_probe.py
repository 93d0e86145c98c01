"""Decode kernels to read under Nsight Compute (ncu): where the short-context decode steps lose their time.

Cases (each one launch sequence, Llama-3.1-8B's or Qwen3-0.6B's shapes, 192 tokens of context: the middle of
the latency rows' 128-in / 128-out runs):
  attn_b64 / attn_b16   decode attention with its fused prep (RoPE, KV store) and folded input norm at batch 64 /
                        16, Llama-8B's 32 / 8 heads: 22-23 us a layer at batch 64 in the model (72% of HBM) and
                        ~11 us at 16 (~30%; 9.2-10.8 us with the b16 one-split graphs' wide tile: WIDE_TILE_CONFIG),
                        where long contexts reach 95-105%
  b1_main               Qwen3-0.6B batch 1 as the main decode graph runs it: attention over 16 splits, the reduce
                        launch, o_proj's whole-row GEMV on the merged row
  b1_merged             the merged batch-1 graph's (GYRFALCON_B1_MERGED_SPLITS=2): 2 splits' partials, o_proj
                        merging them while it loads its input (lost on the H200, run 61: 0.673 vs 0.632 ms a
                        graph replay at 128 tokens)

`python3 benchmarks/ncu_probe.py` times each case in a CUDA graph (no profiler); with --ncu it runs each case
(--only: some) once to compile, then once inside an NVTX range "probe", for
`ncu --nvtx --nvtx-include "probe/" ... python3 benchmarks/ncu_probe.py --ncu`. ncu runs the kernels one at a time
(no PDL overlap), so its durations are the kernels' own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from small_m_gemv import graph_time_us, kv_pool, real_decode_inputs  # noqa: E402

from gyrfalcon.bench.common import run_info  # noqa: E402
from gyrfalcon.kernels.paged_decode_attention import decode_attention_with_prep_triton  # noqa: E402
from gyrfalcon.kernels.small_m_gemv import (default_config, merged_config, merged_heads_gemv_triton,  # noqa: E402
                                            norm_gemv_triton)

CTX = 192


def _attn_case(B: int, n_heads: int, hidden: int, pool, **kw):
    """A launch of decode attention with prep over B sequences of CTX tokens (consecutive blocks), graph-width
    block table (40960 tokens, as the decode graphs' max_model_len makes it)."""
    x = real_decode_inputs(B, CTX, pool, scattered=False, n_heads=n_heads)
    width = 40960 // 16
    bt = torch.zeros(B, width, dtype=torch.int32, device="cuda")
    bt[:, :x["bt"].shape[1]] = x["bt"]
    d = x["d"]
    resid = torch.randn(B, hidden, device="cuda", dtype=torch.bfloat16)

    def run(**more):
        return decode_attention_with_prep_triton(
            x["qkv"], n_heads, x["n_kv"], d, x["positions"], x["cos_sin"], d, True, x["k_cache"], x["v_cache"],
            x["slots"], bt, x["seq_lens"], d ** -0.5, **{**kw, **more})
    return run, resid


def cases():
    pool = kv_pool(64 * (CTX // 16 + 1), "cuda")
    out = {}
    for B in (64, 16):
        run, resid = _attn_case(B, 32, 4096, pool)
        # b16 as its one-split graph runs it up to 256 tokens (WIDE_TILE_CONFIG); b64 runs one split anyway
        out[f"attn_b{B}"] = lambda run=run, resid=resid, B=B: run(row_scale=(resid, 1e-5),
                                                                  num_splits=1 if B == 16 else None)
    # Qwen3-0.6B batch 1: 16 / 8 heads, hidden 1024; o_proj [1024, 2048]
    run, _ = _attn_case(1, 16, 1024, pool)
    w = (torch.randn(1024, 2048, device="cuda") / 2048 ** 0.5).to(torch.bfloat16)
    whole = default_config(1, 1024, 2048, whole_row=True)

    # With PDL, as the batch-1 graphs launch them (first K/V tile and weights loaded before the wait)
    def b1_main():
        o = run(pdl=True).reshape(1, 2048)
        return norm_gemv_triton(o, w, config=whole, pdl=True)[0]

    def b1_merged():
        parts = run(num_splits=2, partials=True, pdl=True)
        return merged_heads_gemv_triton(parts, w, config=merged_config(1024, 2048, 2, 2, True), pdl=True)
    out["b1_main"], out["b1_merged"] = b1_main, b1_merged
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ncu", action="store_true", help="compile, then each case once inside the NVTX range 'probe'")
    ap.add_argument("--only", nargs="+", help="these cases only")
    ap.add_argument("--output-json")
    args = ap.parse_args()
    cs = cases()
    if args.only:
        cs = {k: v for k, v in cs.items() if k in args.only}
    if args.ncu:
        for f in cs.values():
            f()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("probe")
        for name, f in cs.items():
            torch.cuda.nvtx.range_push(name)
            f()
            torch.cuda.nvtx.range_pop()
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        return
    rows = {}
    for name, f in cs.items():
        rows[name] = round(graph_time_us([f]), 2)
        print(f"{name}: {rows[name]:.2f} us a launch sequence (CUDA graph, back to back)", flush=True)
    if args.output_json:
        with open(args.output_json, "w") as fh:
            info = {**run_info(args), "command": "python3 benchmarks/ncu_probe.py " + " ".join(sys.argv[1:])}
            json.dump({"benchmark": "ncu_probe", **info, "ctx": CTX, "us": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
