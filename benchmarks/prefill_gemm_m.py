"""cuBLAS's rate on a prefill step's GEMMs as the token count M varies: a round M (a multiple of 128 or 256)
against the odd ones a throughput run's mixed steps have (8,192 prompt tokens plus ~290 decoders, say).

The throughput row's mixed prefill steps ran their GEMMs at ~660 TFLOP/s (benchmarks/mixed_step.py, run 35),
a 64 x 128-token prefill's at ~740. If odd M costs cuBLAS a poorer kernel, padding an eager step's token
count to the next round M (the padded rows computed and dropped) would pay back more than the rows cost.
Each of the model's four layer GEMMs (qkv, o_proj, gate_up, down) is timed alone at every M, with CUDA
events, and the step's sum compared with the round M just above it. The Ms are timed in --rounds rounds, in
alternating order (forward, then backward, ...), --reps per GEMM and round, and each GEMM's time is the
median over all of them: run 38 timed them once each in order, and the rate fell from 770 TFLOP/s at the
first M to 668 at the fourth, a drift (the GPU's clocks under sustained GEMMs?) that a one-pass order
charges to the later Ms. Each round's layer time per M is kept, so the drift shows.

--blas cublas cublaslt times every M under each of torch's BLAS back ends
(torch.backends.cuda.preferred_blas_library), whose heuristics pick different kernels: at decode-sized M
(a throughput run's 288-384 decoders) cuBLAS ran the layer GEMMs at ~550 TFLOP/s (mixed_step.py, run 35), a
large prefill's at ~740. "default" leaves torch's choice alone.

python3 benchmarks/prefill_gemm_m.py [--preset llama-3.1-8b] [--ms 8192 8479 8576 16384 16763 16896]
    [--reps 20] [--rounds 4] [--blas default cublaslt] [--output-json FILE]
On a CPU (the tests) it times torch's CPU GEMMs at the --ms given, which checks the plumbing only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from gyrfalcon.bench.common import run_info
from gyrfalcon.bench.make_checkpoint import build_config


def layer_gemms(cfg) -> dict:
    """{name: (K, N)} of one decoder layer's GEMMs: x [M, K] @ W^T [K, N]."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    hd = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    return {"qkv": (h, q + 2 * kv), "o_proj": (q, h), "gate_up": (h, 2 * inter), "down": (inter, h)}


def times_ms(fn, reps: int, cuda: bool) -> list:
    fn()
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return times


def round_up(m: int, to: int) -> int:
    return -(-m // to) * to


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--ms", type=int, nargs="+", default=[8192, 8479, 8576, 8704, 16384, 16763, 16768, 16896])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--blas", nargs="+", default=["default"], choices=["default", "cublas", "cublaslt"],
                   help="torch's BLAS back ends to time each M under (CUDA only; on a CPU only the label changes)")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    gemms = layer_gemms(build_config(args.preset, num_layers=1))
    weights = {name: torch.randn(n, k, device=dev, dtype=dtype) * 0.02 for name, (k, n) in gemms.items()}
    inputs = {m: {name: torch.randn(m, k, device=dev, dtype=dtype) for name, (k, _) in gemms.items()}
              for m in args.ms}
    # Every (M, back end) pair is one variant; the rounds alternate their order.
    variants = [(m, b) for m in args.ms for b in args.blas]
    initial = torch.backends.cuda.preferred_blas_library() if cuda else None
    samples = {v: {name: [] for name in gemms} for v in variants}
    round_ms = {v: [] for v in variants}  # the layer's GEMMs per round: the drift across the run
    for rnd in range(args.rounds):
        for m, blas in (variants if rnd % 2 == 0 else list(reversed(variants))):
            if cuda:
                torch.backends.cuda.preferred_blas_library(initial if blas == "default" else blas)
            layer = 0.0
            for name in gemms:
                x, w = inputs[m][name], weights[name]
                t = times_ms(lambda: torch.nn.functional.linear(x, w), args.reps, cuda)
                samples[m, blas][name] += t
                layer += statistics.median(t)
            round_ms[m, blas].append(layer)
    if cuda:
        torch.backends.cuda.preferred_blas_library(initial)
    rows = []
    for m, blas in variants:
        row = {"M": m, "blas": blas, "ms": {}, "tflop_s": {}, "round_layer_ms": round_ms[m, blas]}
        for name, (k, n) in gemms.items():
            ms = statistics.median(samples[m, blas][name])
            row["ms"][name] = ms
            row["tflop_s"][name] = 2 * m * k * n / (ms * 1e-3) / 1e12
        row["layer_ms"] = sum(row["ms"].values())
        row["layer_tflop_s"] = 2 * m * sum(k * n for k, n in gemms.values()) / (row["layer_ms"] * 1e-3) / 1e12
        rows.append(row)
        print(f"M {m:6d} {blas:>8}: layer GEMMs {row['layer_ms']:.3f} ms, {row['layer_tflop_s']:.0f} TFLOP/s ("
              + ", ".join(f"{nm} {row['tflop_s'][nm]:.0f}" for nm in gemms) + "); by round "
              + " / ".join(f"{x:.3f}" for x in round_ms[m, blas]))
    # Each M against the round M's measured above it, under the same back end: would padding to them be cheaper?
    by_m = {(r["M"], r["blas"]): r for r in rows}
    for r in rows:
        for to in (128, 256):
            up = round_up(r["M"], to)
            if up != r["M"] and (up, r["blas"]) in by_m:
                r[f"padded_to_{to}_ms"] = by_m[up, r["blas"]]["layer_ms"]
                print(f"M {r['M']} {r['blas']}: {r['layer_ms']:.3f} ms as is, {r[f'padded_to_{to}_ms']:.3f} ms "
                      f"padded to {up} ({r[f'padded_to_{to}_ms'] / r['layer_ms']:.3f}x)")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({**run_info(args), "device": torch.cuda.get_device_name() if cuda else "cpu", "gemms": gemms,
                       "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
