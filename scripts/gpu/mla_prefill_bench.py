"""One MLA layer's prefill attention at DeepSeek-V3's real dims on the GPU, absorbed form against expanded form.

absorbed: q_nope W_UK (the absorbed query), the tiled prefill kernel over the paged latent cache, W_UV after it;
expanded: layers/mla_expanded.py's path (context rows gathered from the cache, kv_b_proj, the expanded kernel). Both
from the same bf16 cache and query, one fresh prompt of --tokens tokens (or a chunk of --tokens over --prefix
cached tokens); prints the median milliseconds of each (CUDA events, after warm-up) and the FLOP ratio the layer's
rule uses, and writes them as JSON (--output-json). Not a test: nothing is asserted; tests/gpu/test_mla_prefill_gpu.py
holds the two forms equal.

python3 scripts/gpu/mla_prefill_bench.py [--tokens 8192] [--prefix 0] [--heads 128] [--output-json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np
import torch

import gyrfalcon.layers.mla_expanded as mla_expanded
from gyrfalcon.kernels.mla_attention import mla_prefill_tiled_triton
from gyrfalcon.layers.linear import Linear
from gyrfalcon.runner.forward_batch import ForwardBatch

L, NOPE, R, V, BS = 512, 128, 64, 128, 64


def _time(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--prefix", type=int, default=0)
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--output-json")
    args = p.parse_args(argv)
    H, T, S = args.heads, args.tokens, args.tokens + args.prefix
    dev, bf = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    n_blocks = -(-S // BS)
    cache = torch.randn(n_blocks, BS, 1, L + R, device=dev).to(bf)
    bt = torch.randperm(n_blocks, device=dev).to(torch.int32)[None]
    fb = ForwardBatch(input_ids=torch.zeros(T, dtype=torch.int64, device=dev), positions=None, slot_mapping=None,
                      query_start_loc=torch.tensor([0, T], dtype=torch.int32, device=dev),
                      seq_lens=torch.tensor([S], dtype=torch.int32, device=dev), block_tables=bt, logits_indices=None,
                      is_decode=False, max_query_len=T, max_seq_len=S, num_seqs=1)
    kv_b = Linear(L, H * (NOPE + V)).to(dev)
    kv_b.weight.copy_(torch.randn(H * (NOPE + V), L, device=dev) / L ** 0.5)
    kv_b = kv_b.to(bf)
    w = kv_b.weight.view(H, NOPE + V, L)
    q = torch.randn(T, H, NOPE + R, device=dev).to(bf)
    scale = (NOPE + R) ** -0.5

    def absorbed():
        q_lat = torch.bmm(q[..., :NOPE].transpose(0, 1), w[:, :NOPE]).transpose(0, 1)
        q_abs = torch.cat([q_lat, q[..., NOPE:]], dim=-1)
        o_lat = mla_prefill_tiled_triton(q_abs, cache, bt, fb.seq_lens, fb.query_start_loc, scale, L)
        return torch.bmm(o_lat.transpose(0, 1), w[:, NOPE:].transpose(1, 2)).transpose(0, 1).reshape(T, -1)

    plan = mla_expanded.ExpandedPrefillPlan.for_batch(fb)

    def expanded():
        return mla_expanded.attend_expanded(plan, q[..., :NOPE], q[..., NOPE:], cache, fb, kv_b, H, L, V, scale)

    err = (absorbed().float() - expanded().float()).abs().max().item()
    ms_abs, ms_exp = _time(absorbed, args.reps), _time(expanded, args.reps)
    flops_abs, flops_exp = mla_expanded.ExpandedPrefillPlan(np.array([T]), np.array([S])).flops(L, NOPE, R, V)
    res = {"tokens": T, "prefix": args.prefix, "heads": H, "absorbed_ms": ms_abs, "expanded_ms": ms_exp,
           "speedup": ms_abs / ms_exp, "flop_ratio": flops_abs / flops_exp, "max_abs_diff": err,
           "absorbed_tflops": flops_abs * H / ms_abs / 1e9, "expanded_tflops": flops_exp * H / ms_exp / 1e9,
           "device": torch.cuda.get_device_name()}
    print(json.dumps(res, indent=1))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
