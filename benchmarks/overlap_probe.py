"""Can a throughput decode step's attention and GEMMs overlap on the GPU? Two nano-batches on two streams.

The throughput row (768 prompts x 1024 in / 1024 out, Llama-3.1-8B) spends most of its time in decode steps of
~384 sequences at ~1.5k tokens of context, whose layers run decode attention (memory-bound: the K/V reads, ~18.5
ms a step at 4.15 TB/s) and then the GEMMs (compute-bound at 384 rows: ~9.6 ms a step at the 558 TFLOP/s cuBLAS
reaches there) one after another; docs/performance.md: ~10,530 tok/s at best that way, where the row asks 11,000.
Split into two halves on two CUDA streams (NanoFlow's nano-batches), one half's attention could run while the other
half's GEMMs do, if the GPU runs the two kernels at once. This probe times one decoder layer's decode kernels at
Llama-3.1-8B's shapes over `--layers` layers of distinct weights and caches (nothing stays in L2), each schedule
captured in one CUDA graph:

  attn       decode attention (with its fused prep) of the whole batch alone
  gemm       the layer's GEMMs and SiLU-and-mul of the whole batch alone
  seq        the whole batch's layer, one stream: what the model runs now
  halves     the two halves' layers one after another on one stream: the cost of splitting (weights read twice)
  overlap    the two halves on two streams, free-running (the GPU interleaves their kernels as SMs free up)
  overlap_hp the same with the second half's stream at high priority (its blocks dispatch first)
  overlap_co the same as overlap with cuBLASLt and an SM carveout on the GEMMs (--carveout SMs left to the other
             stream's attention; torch._C._set_sm_carveout_experimental), where torch has it

Prints each schedule's time per layer and overlap's ratio to seq; --output-json writes them.

H200, run 66 (overlap_probe-h200-2026-12-01-run66.json, 384 sequences at 1,536 tokens): attn 596.6 us a layer
(97% of 4.15 TB/s), gemm 216.9, seq 817.6 (their sum), halves 911.2, overlap 863.6 (0.947x of seq), overlap_hp
871.4, overlap_co 1,035.6: the halves overlap, by less than their second read of the weights costs.

python3 benchmarks/overlap_probe.py [--batch 384] [--ctx 1536] [--layers 4] [--carveout 32] [--output-json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from small_m_gemv import graph_time_us  # noqa: E402

from gyrfalcon.bench.common import run_info  # noqa: E402
from gyrfalcon.kernels import silu_and_mul  # noqa: E402
from gyrfalcon.kernels.paged_decode_attention import decode_attention_with_prep_triton  # noqa: E402

H, KV, D, HID, INTER = 32, 8, 128, 4096, 14336  # Llama-3.1-8B
BLOCK = 16


def make_layers(B: int, ctx: int, layers: int, dev: str = "cuda", dtype=torch.bfloat16):
    """Per layer: weights (qkv [6144, 4096], o [4096, 4096], gate_up [28672, 4096], down [4096, 14336]) and a
    K/V cache holding B sequences of ctx tokens (consecutive blocks, the new token at ctx - 1)."""
    bf = dtype
    per = -(-ctx // BLOCK)
    bt = torch.arange(B * per, dtype=torch.int32, device=dev).view(B, per)
    sl = torch.full((B,), ctx, dtype=torch.int32, device=dev)
    pos = sl.long() - 1
    slots = bt[:, -1].long() * BLOCK + pos % BLOCK
    inv = 1.0 / (500000 ** (torch.arange(0, D, 2, device=dev).float() / D))
    freqs = torch.outer(torch.arange(ctx + 1, device=dev).float(), inv)
    cs = torch.cat([freqs.cos(), freqs.sin()], -1)
    out = []
    for _ in range(layers):
        w = {n: (torch.randn(*s, device=dev) / s[1] ** 0.5).to(bf) for n, s in
             (("qkv", ((H + 2 * KV) * D, HID)), ("o", (HID, H * D)), ("gu", (2 * INTER, HID)), ("d", (HID, INTER)))}
        kc = torch.randn(B * per, BLOCK, KV, D, device=dev).to(bf)
        vc = torch.randn(B * per, BLOCK, KV, D, device=dev).to(bf)
        out.append((w, kc, vc))
    return out, dict(bt=bt, sl=sl, pos=pos, slots=slots, cs=cs)


def layer_fns(layers, inp, rows: slice, resid: torch.Tensor):
    """(attention, gemms) closures per layer for the batch rows `rows` (resid: those rows' residual stream)."""
    bt, sl, pos, slots, cs = (inp[k][rows] if k != "cs" else inp[k] for k in ("bt", "sl", "pos", "slots", "cs"))
    M = resid.shape[0]
    qkv = resid.new_empty(M, (H + 2 * KV) * D)
    fns = []
    for w, kc, vc in layers:
        def attn(w=w, kc=kc, vc=vc):
            torch.matmul(resid, w["qkv"].t(), out=qkv)
            o = decode_attention_with_prep_triton(qkv, H, KV, D, pos, cs, D, True, kc, vc, slots, bt, sl, D ** -0.5,
                                                  row_scale=(resid, 1e-5))
            return o.view(M, H * D)

        def mlp(o, w=w):
            resid.addmm_(o, w["o"].t())
            act = silu_and_mul(F.linear(resid, w["gu"]))
            resid.addmm_(act, w["d"].t())
        fns.append((attn, mlp))
    return fns


def graph_ms(body) -> float:
    """Milliseconds one call of body() takes (all its streams joined), timed in a CUDA graph (graph_time_us)."""
    return graph_time_us([body], reps=3) / 1e3


def two_streams(chain_a, chain_b, high_priority_b: bool = False):
    """A body running chain_a and chain_b on two side streams forked from and joined to the current one."""
    sa = torch.cuda.Stream()
    sb = torch.cuda.Stream(priority=-1) if high_priority_b else torch.cuda.Stream()

    def body():
        cur = torch.cuda.current_stream()
        sa.wait_stream(cur)
        sb.wait_stream(cur)
        with torch.cuda.stream(sa):
            chain_a()
        with torch.cuda.stream(sb):
            chain_b()
        cur.wait_stream(sa)
        cur.wait_stream(sb)
    return body


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=384)
    ap.add_argument("--ctx", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--carveout", type=int, default=32, help="SMs the GEMMs leave free in overlap_co")
    ap.add_argument("--output-json")
    args = ap.parse_args()
    B, L = args.batch, args.layers
    layers, inp = make_layers(B, args.ctx, L)
    resid = torch.randn(B, HID, device="cuda", dtype=torch.bfloat16) * 0.1
    half = B // 2
    full = layer_fns(layers, inp, slice(0, B), resid)
    ha = layer_fns(layers, inp, slice(0, half), resid[:half])
    hb = layer_fns(layers, inp, slice(half, B), resid[half:])
    outs = [torch.empty(B, H * D, device="cuda", dtype=torch.bfloat16) for _ in range(L)]

    def run_chain(fns):
        def chain():
            for attn, mlp in fns:
                mlp(attn())
        return chain

    def attn_only():
        for attn, _ in full:
            attn()

    def gemm_only():
        for i, (_, mlp) in enumerate(full):
            mlp(outs[i])

    def halves():
        for (aa, ma), (ab, mb) in zip(ha, hb):
            ma(aa())
            mb(ab())

    res = {}
    for name, body in (("attn", attn_only), ("gemm", gemm_only), ("seq", run_chain(full)), ("halves", halves),
                       ("overlap", two_streams(run_chain(ha), run_chain(hb))),
                       ("overlap_hp", two_streams(run_chain(ha), run_chain(hb), high_priority_b=True))):
        res[name] = graph_ms(body) / L
        print(f"{name:10s} {res[name] * 1e3:8.1f} us a layer", flush=True)
    setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if setter is not None:
        prev = torch.backends.cuda.preferred_blas_library()
        try:
            torch.backends.cuda.preferred_blas_library("cublaslt")
            res["seq_lt"] = graph_ms(run_chain(full)) / L
            setter(args.carveout)
            res["overlap_co"] = graph_ms(two_streams(run_chain(ha), run_chain(hb))) / L
        except Exception as e:  # a torch without the carveout on this path
            print(f"overlap_co skipped: {type(e).__name__}: {e}", file=sys.stderr)
        finally:
            setter(None)
            torch.backends.cuda.preferred_blas_library(prev)
        for name in ("seq_lt", "overlap_co"):
            if name in res:
                print(f"{name:10s} {res[name] * 1e3:8.1f} us a layer", flush=True)
    ratios = {k: round(res["seq"] / v, 3) for k, v in res.items() if k.startswith("overlap")}
    print(f"seq / overlap: {ratios}; attn + gemm {(res['attn'] + res['gemm']) * 1e3:.1f} us vs seq "
          f"{res['seq'] * 1e3:.1f}", flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            info = {**run_info(args), "command": "python3 benchmarks/overlap_probe.py " + " ".join(sys.argv[1:])}
            json.dump({"benchmark": "overlap_probe", **info, "batch": B, "ctx": args.ctx, "layers": L,
                       "us_per_layer": {k: round(v * 1e3, 2) for k, v in res.items()},
                       "seq_over_overlap": ratios}, f, indent=1)


if __name__ == "__main__":
    main()
