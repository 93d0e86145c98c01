"""GYRFALCON_SILU_INTO_DOWN's launches one by one, on the GPU: where does its time go?

Run 107 (gpu_check.sh siludown) measured the whole mode at 21.3 ms a Llama-3.1-8B b16 decode step against 4.3
without, and 2.76 against 1.10 ms at Qwen3-0.6B b16. This times each launch of the MLP half of a decode layer at
the real shapes, unfused (o_proj adding into the residual, the scaled SiLU-and-mul kernel on gate_up's output,
down_proj) against the mode's (o_proj writing its rows' sums of squares, down_proj building its input from gate_up's
output), each launch alone and the chain, replayed as CUDA graphs over rotating weight copies (L2-cold for
Llama's weights), at the launch shape default_config picks and a few others for the silu_x launch.

    python benchmarks/silu_into_down.py [--ms 2 8 16] [--output-json F]
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from gyrfalcon.bench.common import run_info  # noqa: E402
from gyrfalcon.kernels.activation import silu_and_mul  # noqa: E402
from gyrfalcon.kernels.small_m_gemv import GemvConfig, default_config, norm_gemv_triton  # noqa: E402

# name: (hidden, attention width (o_proj's K), intermediate)
SHAPES = {"llama-3.1-8b": (4096, 4096, 14336), "qwen3-0.6b": (1024, 2048, 3072)}
EXTRA_SILU_X = [GemvConfig(32, 128, 4, 3), GemvConfig(32, 64, 4, 4), GemvConfig(16, 128, 4, 3),
                GemvConfig(64, 64, 4, 3), GemvConfig(32, 128, 8, 2)]
EPS = 1e-5


def graph_time_us(fn, reps: int = 20, iters: int = 10) -> float:
    """Median us per fn() call: reps calls captured in one graph, replayed iters times."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return sorted(times)[len(times) // 2]


def bench_shape(name: str, M: int, copies: int = 4) -> dict:
    hidden, heads, inter = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(M)
    a = torch.randn(M, heads, device="cuda", generator=g).bfloat16()
    res = torch.randn(M, hidden, device="cuda", generator=g).bfloat16()
    gu = torch.randn(M, 2 * inter, device="cuda", generator=g).bfloat16()
    h = torch.randn(M, inter, device="cuda", generator=g).bfloat16()
    wo = [(torch.randn(hidden, heads, device="cuda", generator=g) / heads ** 0.5).bfloat16() for _ in range(copies)]
    wd = [(torch.randn(hidden, inter, device="cuda", generator=g) / inter ** 0.5).bfloat16() for _ in range(copies)]
    _, parts = norm_gemv_triton(a, wo[0], add_to=res.clone(), sumsq=True)
    it = {"i": 0}

    def nxt(ws):
        it["i"] = (it["i"] + 1) % copies
        return ws[it["i"]]

    def o_plain():
        norm_gemv_triton(a, nxt(wo), add_to=res)

    def o_sumsq():
        norm_gemv_triton(a, nxt(wo), add_to=res, sumsq=True)

    def silu():
        silu_and_mul(gu, row_scale=(res, EPS))

    def d_plain():
        norm_gemv_triton(h, nxt(wd), add_to=res)

    def d_silu_x(cfg=None):
        norm_gemv_triton(gu, nxt(wd), add_to=res, silu_x=(parts, hidden, EPS), config=cfg)

    def chain_plain():
        o_plain()
        y = silu_and_mul(gu, row_scale=(res, EPS))
        norm_gemv_triton(y, nxt(wd), add_to=res)

    def chain_fused():
        _, p = norm_gemv_triton(a, nxt(wo), add_to=res, sumsq=True)
        norm_gemv_triton(gu, nxt(wd), add_to=res, silu_x=(p, hidden, EPS))

    out = {"M": M, "shape": name,
           "silu_x_default_config": list(default_config(M, hidden, inter, x_tiles=2)),
           "plain_default_config": list(default_config(M, hidden, inter))}
    for key, fn in [("o_proj", o_plain), ("o_proj_sumsq", o_sumsq), ("silu_and_mul", silu),
                    ("down_proj", d_plain), ("down_proj_silu_x", d_silu_x),
                    ("chain_unfused", chain_plain), ("chain_silu_into_down", chain_fused)]:
        out[key + "_us"] = round(graph_time_us(fn), 2)
    for cfg in EXTRA_SILU_X:
        out["down_proj_silu_x_" + ",".join(map(str, cfg)) + "_us"] = round(graph_time_us(lambda: d_silu_x(cfg)), 2)
    out["down_bytes_us_at_4.15TBps"] = round(hidden * inter * 2 / 4.15e6, 2)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", type=int, nargs="+", default=[2, 8, 16])
    ap.add_argument("--output-json")
    args = ap.parse_args()
    rows = []
    for name in SHAPES:
        for M in args.ms:
            r = bench_shape(name, M)
            rows.append(r)
            print(json.dumps(r), flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"bench": "silu_into_down", **run_info(args), "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
