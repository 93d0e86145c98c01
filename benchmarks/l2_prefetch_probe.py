"""Does o_proj's weight, prefetched into L2 beside decode attention, shorten a batched decode layer?

Llama-3.1-8B's decoder layer at decode batch sizes (16 / 64 sequences, ~190 tokens of context), its kernels as the
batched decode graphs run them (qkv GEMM, decode attention with its fused prep, o_proj, gate_up, SiLU-and-mul,
down_proj; cuBLAS for the GEMMs here), over `--layers` layers of distinct weights and caches (nothing stays in L2
from one layer to the next), each schedule captured in one CUDA graph (graph_time_us), in alternating rounds:

  seq     the layer as the model runs it now
  seq_pf  the same with o_proj's weight prefetched into L2 on a side branch forked after the qkv GEMM and joined
          before o_proj (layers/side_prefetch.SidePrefetch, GYRFALCON_ATTN_L2_PREFETCH), evict-last
  seq_pfn the same at the normal eviction priority (GYRFALCON_ATTN_L2_PREFETCH_EVICT=normal)
  attn / attn_pf   the qkv GEMM and attention alone, without / with the prefetch beside them (what it costs them)
  o / o_pf  o_proj alone (L2 cold) / right after the prefetch of its weight (the most the prefetch can save)

Prints microseconds a layer and seq / seq_pf; --output-json writes them.

python3 benchmarks/l2_prefetch_probe.py [--batch 16 64] [--ctx 192] [--layers 8] [--rounds 3] [--output-json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import overlap_probe as op  # noqa: E402
from small_m_gemv import graph_time_us  # noqa: E402

from gyrfalcon.bench.common import run_info, scoped_env  # noqa: E402
from gyrfalcon.kernels import silu_and_mul  # noqa: E402
from gyrfalcon.kernels._common import pdl_warmup  # noqa: E402
from gyrfalcon.kernels.l2_prefetch import l2_prefetch  # noqa: E402
from gyrfalcon.kernels.paged_decode_attention import decode_attention_with_prep_triton  # noqa: E402
from gyrfalcon.layers.side_prefetch import SidePrefetch  # noqa: E402


def schedules(layers, inp, resid: torch.Tensor) -> dict:
    """name -> body() running every layer once (op.make_layers' layers and inputs; resid [B, hidden]: the
    residual stream the bodies update in place). The dimensions are overlap_probe's (op.H, ...)."""
    H, KV, D = op.H, op.KV, op.D
    B = resid.shape[0]
    bt, sl, pos, slots, cs = (inp[k] for k in ("bt", "sl", "pos", "slots", "cs"))
    qkv = resid.new_empty(B, (H + 2 * KV) * D)

    def attn(w, kc, vc, pf: bool, evict: str = "last"):
        torch.matmul(resid, w["qkv"].t(), out=qkv)
        with scoped_env({"GYRFALCON_ATTN_L2_PREFETCH_EVICT": evict}), \
                (SidePrefetch(w["o"], B) if pf else contextlib.nullcontext()):
            o = decode_attention_with_prep_triton(qkv, H, KV, D, pos, cs, D, True, kc, vc, slots, bt, sl, D ** -0.5,
                                                  row_scale=(resid, 1e-5))
        return o.view(B, H * D)

    def mlp(o, w):
        resid.addmm_(o, w["o"].t())
        resid.addmm_(silu_and_mul(F.linear(resid, w["gu"])), w["d"].t())

    o_in = resid.new_zeros(B, H * D)

    def body(kind: str):
        def run():
            for w, kc, vc in layers:
                if kind in ("seq", "seq_pf", "seq_pfn"):
                    mlp(attn(w, kc, vc, kind != "seq", "normal" if kind == "seq_pfn" else "last"), w)
                elif kind in ("attn", "attn_pf"):
                    attn(w, kc, vc, kind == "attn_pf")
                else:  # o / o_pf
                    if kind == "o_pf":
                        l2_prefetch(w["o"])
                    resid.addmm_(o_in, w["o"].t())
        return run
    return {k: body(k) for k in ("seq", "seq_pf", "seq_pfn", "attn", "attn_pf", "o", "o_pf")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--ctx", type=int, default=192)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output-json")
    args = ap.parse_args()
    rows = []
    with scoped_env({"GYRFALCON_ATTN_L2_PREFETCH": "512"}):  # SidePrefetch acts while graph_time_us captures
        for B in args.batch:
            layers, inp = op.make_layers(B, args.ctx, args.layers)
            bodies = schedules(layers, inp, torch.randn(B, op.HID, device="cuda", dtype=torch.bfloat16) * 0.1)
            with pdl_warmup():  # compile every kernel (the side branch's too) before the captures
                for body in bodies.values():
                    body()
            torch.cuda.synchronize()
            times = {k: [] for k in bodies}
            for r in range(args.rounds):
                for k in (list(bodies) if r % 2 == 0 else list(bodies)[::-1]):
                    times[k].append(graph_time_us([bodies[k]], reps=3) / args.layers)
            med = {k: statistics.median(v) for k, v in times.items()}
            row = {"batch": B, "ctx": args.ctx, "layers": args.layers,
                   "us_per_layer": {k: round(v, 2) for k, v in med.items()},
                   "rounds_us": {k: [round(x, 2) for x in v] for k, v in times.items()},
                   "seq_over_seq_pf": round(med["seq"] / med["seq_pf"], 4)}
            rows.append(row)
            print(f"B={B:3d} ctx={args.ctx}: " + ", ".join(f"{k} {v:.1f}" for k, v in med.items())
                  + f" us a layer; seq / seq_pf x{row['seq_over_seq_pf']:.3f}", flush=True)
            del layers, inp, bodies
            torch.cuda.empty_cache()
    if args.output_json:
        with open(args.output_json, "w") as f:
            info = {**run_info(args), "command": "python3 benchmarks/l2_prefetch_probe.py " + " ".join(sys.argv[1:])}
            json.dump({"benchmark": "l2_prefetch_probe", **info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
