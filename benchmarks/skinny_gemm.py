"""The stream-K skinny GEMM (gyrfalcon/kernels/skinny_gemm.py) against cuBLAS on a decoder layer's GEMMs at
decode-sized row counts: default launch shape, and (--sweep) a sweep of launch shapes at the rows given.

Timed as benchmarks/small_m_gemv.py times its GEMVs: a CUDA graph of the op over enough distinct weight copies
(>= 256 MB) that nothing stays in L2 between calls, the time per call being the graph's time over the calls.
o_proj and down_proj run as the folded-norm layers run them, adding into the residual stream (cuBLAS's
addmm_ with beta = 1; the kernel's ADD_OUT); qkv and gate_up plain. Bandwidth is weight bytes (plus the
input and output rows) against the 4.15 TB/s roofline. Each row count also gets the layer's sum: cuBLAS vs
the kernel's default vs the best shape per GEMM.

Each GEMM is also timed with cuBLAS's operands swapped (y^T = W x^T): it tied F.linear on the H200 (run 65,
skinny_gemm_swap-h200-2026-12-01-run65.json: Llama-8B's layer at 64 rows 128.3 vs 128.5 us, at 16 rows 120.7 vs
121.4).

python3 benchmarks/skinny_gemm.py [--preset llama-3.1-8b qwen3-0.6b] [--ms 16 64 128] [--sweep] [--sweep-ms 64]
    [--output-json FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import torch.nn.functional as F

from gyrfalcon.bench.common import HBM_BYTES_PER_S, run_info
from gyrfalcon.kernels.skinny_gemm import SMEM_BUDGET, SkinnyConfig, default_config, skinny_gemm_triton

# preset: {gemm: (K, N, adds into the residual stream)}
LAYERS = {
    "llama-3.1-8b": {"qkv": (4096, 6144, False), "o_proj": (4096, 4096, True), "gate_up": (4096, 28672, False),
                     "down": (14336, 4096, True)},
    "qwen3-0.6b": {"qkv": (1024, 4096, False), "o_proj": (2048, 1024, True), "gate_up": (1024, 6144, False),
                   "down": (3072, 1024, True)},
}


def sweep_configs(M: int):
    """Launch shapes whose pipelined tiles fit in 200 KB of shared memory: 64-, 128- and 256-row weight tiles
    (4 warps, 4 or 8, 8), 64 or 128 inputs a step, 2-4 stages."""
    bm = max(16, 1 << (M - 1).bit_length())
    for bn, bk, ns in itertools.product((64, 128, 256), (64, 128), (2, 3, 4)):
        for nw in {64: (4,), 128: (4, 8), 256: (8,)}[bn]:
            if (bn + bm) * bk * 2 * ns <= 200 * 1024:
                yield SkinnyConfig(bn, bk, nw, ns)


def bench(args, rows):
    from small_m_gemv import graph_time_us  # a sibling script (benchmarks/ is sys.path[0] when run as one)

    for preset in args.preset:
        for M in args.ms:
            sums = {"cublas": 0.0, "cublas_swapped": 0.0, "skinny": 0.0, "best": 0.0}
            for name, (K, N, add) in LAYERS[preset].items():
                copies = max(1, -(-256 * 2 ** 20 // (N * K * 2)))
                ws = [torch.randn(N, K, device="cuda").div_(K ** 0.5).bfloat16() for _ in range(copies)]
                x = torch.randn(M, K, device="cuda").bfloat16()
                r = torch.randn(M, N, device="cuda").bfloat16()

                def cublas(w):
                    return (lambda: r.addmm_(x, w.t())) if add else (lambda: F.linear(x, w))

                def ours(w, cfg=None):
                    return lambda: skinny_gemm_triton(x, w, add_to=r if add else None, config=cfg)

                ref = (r.float() + x.float() @ ws[0].float().t()).bfloat16() if add else F.linear(x, ws[0])
                got = skinny_gemm_triton(x, ws[0], add_to=r.clone() if add else None)
                err = (got.float() - ref.float()).abs().max().item()
                t_cublas = graph_time_us([cublas(w) for w in ws])
                t_ours = graph_time_us([ours(w) for w in ws])
                # The same product with cuBLAS's operands swapped: y^T [N, M] = W x^T (a consumer would then read
                # y column-major); cuBLAS picks its kernel by the problem's orientation, and F.linear's at M <= 128
                # leaves SMs idle on qkv / o_proj (the module docstring of kernels/skinny_gemm.py)
                xt = x.t()
                t_swap = graph_time_us([lambda w=w: torch.mm(w, xt) for w in ws])
                nbytes = (N * K + M * K + M * N * (2 if add else 1)) * 2
                row = {"preset": preset, "gemm": name, "M": M, "K": K, "N": N, "add": add,
                       "cublas_us": t_cublas, "cublas_swapped_us": t_swap, "skinny_us": t_ours,
                       "default_config": list(default_config(M, N, K)),
                       "speedup": t_cublas / t_ours, "max_abs_err": err,
                       "frac_hbm_cublas": nbytes / HBM_BYTES_PER_S / (t_cublas * 1e-6),
                       "frac_hbm_skinny": nbytes / HBM_BYTES_PER_S / (t_ours * 1e-6)}
                best = (t_ours, list(default_config(M, N, K)))
                if args.sweep and M in args.sweep_ms:
                    swept = []
                    for cfg in sweep_configs(M):
                        try:
                            t = graph_time_us([ours(w, cfg) for w in ws])
                        except Exception as e:  # a shape this Triton cannot compile: skip it, say so
                            print(f"  {name} M={M} {tuple(cfg)}: {type(e).__name__}", file=sys.stderr)
                            continue
                        swept.append((t, list(cfg)))
                    swept.sort()
                    row["sweep_top"] = swept[:6]
                    best = min(best, swept[0]) if swept else best
                row["best_us"], row["best_config"] = best
                sums["cublas"] += t_cublas
                sums["cublas_swapped"] += t_swap
                sums["skinny"] += t_ours
                sums["best"] += best[0]
                rows.append(row)
                print(f"{preset} {name:8s} M={M:4d}: cuBLAS {t_cublas:7.2f} us ({row['frac_hbm_cublas']:.0%}), swapped "
                      f"{t_swap:7.2f}, "
                      f"stream-K {t_ours:7.2f} us ({row['frac_hbm_skinny']:.0%}) x{row['speedup']:.3f}, "
                      f"best {best[0]:7.2f} {best[1]}; max |err| {err:.3g}")
                del ws
            rows.append({"preset": preset, "M": M, "layer_sum_us": sums})
            print(f"{preset} layer M={M}: cuBLAS {sums['cublas']:.1f} us (swapped {sums['cublas_swapped']:.1f}), "
                  f"stream-K default {sums['skinny']:.1f}, "
                  f"best shapes {sums['best']:.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", nargs="+", default=["llama-3.1-8b"], choices=sorted(LAYERS))
    ap.add_argument("--ms", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--sweep", action="store_true", help="also sweep launch shapes at --sweep-ms")
    ap.add_argument("--sweep-ms", type=int, nargs="+", default=[64])
    ap.add_argument("--output-json")
    args = ap.parse_args()
    rows: list = []
    bench(args, rows)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({**run_info(args), "benchmark": "skinny_gemm", "smem_budget": SMEM_BUDGET, "results": rows},
                      f, indent=1)
        print(f"wrote {args.output_json}")


if __name__ == "__main__":
    main()
