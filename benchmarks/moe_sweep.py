"""Launch-shape sweep of the fused-MoE op at the real MoE shapes: Qwen3-30B-A3B (E 128, top-8, H 2048, I 768) and
MiniMax-M2 (E 256, top-8, H 3072, I 1536), bf16 and FP8 (128x128 block) experts, for decode batches of 1-64 tokens
and a 256-token prefill chunk.

Each candidate MoeConfig (block_m, and per GEMM BLOCK_N / BLOCK_K / warps / stages) is timed as a CUDA-graph replay
with L2 flushed (benchmarks/kernels.py _bench_gpu), the routing uniform at random as random-weight benchmarks route.
Prints, per shape and batch, the default config's time, the best one's, and the fraction of the HBM roofline of
the bytes the op must read (the selected experts' weights: common.experts_touched), and writes every timing and
the winners as JSON (rewritten after each row, so a time-boxed run keeps what it finished); the winners are what
kernels/fused_moe/configs.py TUNED / TUNED_FP8 hold. Each distinct tile compiles once (the shapes are runtime arguments).

    PYTHONPATH=$PWD python3 benchmarks/moe_sweep.py --output-json /tmp/moe_sweep.json [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels import HBM_BW, _bench_gpu, _commit  # noqa: E402

from gyrfalcon.bench.common import experts_touched  # noqa: E402
from gyrfalcon.kernels.fused_moe import fused_moe_ref, fused_moe_triton  # noqa: E402
from gyrfalcon.kernels.fp8_gemm import quantize_weight_blockwise  # noqa: E402
from gyrfalcon.kernels.fused_moe.configs import (GemmTile, MoeConfig, default_config, fp8_config,  # noqa: E402
                                                 pairs_bucket)

SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "minimax-m2": (256, 8, 3072, 1536)}
TOKENS = (1, 16, 64, 256)


def candidates(P: int, E: int, quick: bool, fp8: bool):
    """MoeConfigs to time at P pairs: block_m around the average rows per expert, GEMM tiles over N / K / warps /
    stages (the same tile for both GEMMs: they stream weights of one expert's shape). FP8: BLOCK_K is the 128-wide
    weight block and BLOCK_N divides the 128-row one (configs.fp8_config)."""
    avg = P / E
    bms = [16] if avg <= 2 else [16, 32] if avg <= 16 else [32, 64]
    ks = (128,) if fp8 else (64, 128, 256)
    tiles = [GemmTile(n, k, w, s) for n, k, w, s in itertools.product((32, 64, 128), ks, (4, 8), (3, 4))]
    if quick:
        tiles = tiles[::3]
    for bm in bms:
        for up in tiles:
            if up.num_stages * (bm * up.block_k + 2 * up.block_k * up.block_n) * 2 > 220_000:
                continue  # the stages would not fit in shared memory
            yield MoeConfig(bm, up, up)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--quick", action="store_true", help="a third of the tiles")
    ap.add_argument("--dtypes", default="bf16,fp8", help="expert weights to sweep: bf16, fp8 (128x128 blocks)")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: a dry run under TRITON_INTERPRET
    results = {"gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "commit": _commit(), "command": " ".join(sys.argv),
               "rows": []}
    for (name, (E, k, H, inter)), wdt in itertools.product(SHAPES.items(), args.dtypes.split(",")):
        fp8 = wdt == "fp8"
        g = torch.Generator(device=dev).manual_seed(0)
        w13 = torch.randn(E, 2 * inter, H, device=dev, dtype=torch.bfloat16, generator=g) * H ** -0.5
        w2 = torch.randn(E, H, inter, device=dev, dtype=torch.bfloat16, generator=g) * inter ** -0.5
        scales = {}
        if fp8:  # each expert's matrices in 128x128 blocks, as the checkpoints ship them
            q13, s13 = zip(*(quantize_weight_blockwise(w) for w in w13))
            q2, s2 = zip(*(quantize_weight_blockwise(w) for w in w2))
            w13, w2 = torch.stack(q13), torch.stack(q2)
            scales = dict(w13_scale=torch.stack(s13), w2_scale=torch.stack(s2))
        expert_bytes = sum(t[0].numel() * t.element_size() for t in (w13, w2, *scales.values()))
        for T in TOKENS:
            x = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=g)
            ids = torch.stack([torch.randperm(E, device=dev, generator=g)[:k] for _ in range(T)])
            tw = torch.softmax(torch.randn(T, k, device=dev, generator=g), dim=-1)
            want = fused_moe_ref(x, w13, w2, tw, ids, **scales).float()
            P = T * k
            floor_us = expert_bytes * experts_touched(E, k, T) / HBM_BW * 1e6
            dflt = fp8_config(P, E, H, inter) if fp8 else default_config(P, E, H, inter, 2)
            timings = []
            for cfg in [dflt] + [c for c in candidates(P, E, args.quick, fp8) if c != dflt]:
                try:
                    got = fused_moe_triton(x, w13, w2, tw, ids, config=cfg, **scales).float()
                    if not torch.allclose(got, want, atol=3e-2, rtol=3e-2):
                        continue  # a launch shape that computes something else is no candidate
                    us = _bench_gpu(lambda: fused_moe_triton(x, w13, w2, tw, ids, config=cfg, **scales))
                except Exception as e:  # out of shared memory / registers: not a candidate here
                    print(f"  {name} T={T} {cfg}: {type(e).__name__}")
                    continue
                timings.append((us, cfg))
            timings.sort(key=lambda t: t[0])
            best_us, best = timings[0]
            dflt_us = next(us for us, c in timings if c == dflt)
            row = {"shape": name, "weights": wdt, "tokens": T, "pairs": P, "bucket": pairs_bucket(P), "H": H, "I": inter,
                   "floor_us": floor_us, "default": [dflt_us, dflt], "best": [best_us, best],
                   "default_roofline": floor_us / dflt_us, "best_roofline": floor_us / best_us,
                   "top5": timings[:5]}
            results["rows"].append(row)
            print(f"{name:14s} {wdt:4s} T={T:4d}  default {dflt_us:8.1f} us ({floor_us / dflt_us:5.1%})  best "
                  f"{best_us:8.1f} us ({floor_us / best_us:5.1%})  {best}", flush=True)
            if args.output_json:  # after every row: a time-boxed run keeps what it finished
                with open(args.output_json, "w") as f:
                    json.dump(results, f, indent=1,
                              default=lambda o: o._asdict() if hasattr(o, "_asdict") else str(o))
        del w13, w2, scales
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
