"""The host's own cost of one eager step, measured on a CPU: building its inputs and running the model's
forward with every Triton launch skipped and every GEMM returning an empty output, at a real model's shape.

An eager step on the GPU machine pays this Python and torch-dispatch work plus the launches themselves, on a
host several times slower per call than this one. A throughput run's mixed prefill steps (8 prompt chunks
beside ~290 decoders) held the host ~170 ms inside launch() (run 36); this measures the part that is not the
CUDA driver's, so changes to it can be timed without a GPU. The step's layers take the GPU paths
(startup_compiles.gpu_dispatch), so the wrappers' own arithmetic (launch shapes, strides) counts.

python3 benchmarks/eager_host_cost.py [--preset llama-3.1-8b] [--prompts 8] [--input-len 1024]
    [--decoders 288] [--context 1536] [--reps 5] [--profile] [--output-json FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from types import SimpleNamespace

import startup_compiles as sc  # a sibling script: sets TRITON_INTERPRET before torch / triton load

import torch  # noqa: E402


def scheduled(prompts: int, input_len: int, decoders: int, context: int, block_size: int = 16) -> list:
    """ScheduledRequest stand-ins: `prompts` whole prompts of input_len tokens, then `decoders` decode rows
    at `context` tokens, each with its block table."""
    out = []

    def req(i, q, start):
        n = start + q
        r = SimpleNamespace(request_id=f"r{i}", num_tokens=n, token_ids=lambda lo, hi: list(range(lo, hi)),
                            block_ids=list(range(i * 512, i * 512 + -(-n // block_size))))
        return SimpleNamespace(request=r, num_new_tokens=q, start=start, sample=True)
    out += [req(i, input_len, 0) for i in range(prompts)]
    out += [req(prompts + i, 1, context - 1) for i in range(decoders)]
    return out


def main(argv=None) -> int:
    from gyrfalcon.bench.make_checkpoint import PRESETS
    from gyrfalcon.forward_context import forward_context
    from gyrfalcon.runner.forward_batch import build_forward_batch
    from triton.runtime.interpreter import InterpretedFunction

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama-3.1-8b", choices=sorted(PRESETS))
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--decoders", type=int, default=288)
    p.add_argument("--context", type=int, default=1536)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--profile", action="store_true", help="print the forward's cProfile, by own time")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)

    model, kv = sc.shape_model(args.preset, max(4096, args.context + 1))
    spec = model.kv_cache_spec()
    reqs = scheduled(args.prompts, args.input_len, args.decoders, args.context)
    last_sampled = torch.zeros(len(reqs) + 8, dtype=torch.int64)
    embedding = torch.nn.functional.embedding
    run = InterpretedFunction.run
    InterpretedFunction.run = lambda self, *a, grid, warmup, **k: None  # no launch: the host's side only
    # The embedding lookup is a kernel on the GPU; on the CPU it would be real work at these sizes.
    torch.nn.functional.embedding = lambda ids, w, *a, **k: torch.empty(ids.shape[0], w.shape[1], dtype=w.dtype)
    build_ms, forward_ms, prof = [], [], None
    try:
        with sc.gpu_dispatch(), torch.inference_mode():
            for rep in range(args.reps + 1):  # the first is a warm-up
                t0 = time.perf_counter()
                fb = build_forward_batch(reqs, 16, torch.device("cpu"), {}, last_sampled)
                t1 = time.perf_counter()
                if args.profile and rep == args.reps:
                    prof = cProfile.Profile()
                    prof.enable()
                with forward_context(fb, kv):
                    model(fb.input_ids, fb.positions)[fb.logits_indices]
                t2 = time.perf_counter()
                if prof is not None:
                    prof.disable()
                if rep:
                    build_ms.append((t1 - t0) * 1e3)
                    forward_ms.append((t2 - t1) * 1e3)
    finally:
        InterpretedFunction.run = run
        torch.nn.functional.embedding = embedding
    res = {"tokens": fb.num_tokens, "sequences": len(reqs), "layers": spec["num_layers"],
           "build_ms": statistics.median(build_ms), "forward_ms": statistics.median(forward_ms)}
    res["forward_ms_per_layer"] = res["forward_ms"] / spec["num_layers"]
    print(f"{args.preset}: eager step of {res['tokens']} tokens, {res['sequences']} sequences: build inputs "
          f"{res['build_ms']:.2f} ms, forward {res['forward_ms']:.2f} ms ({res['forward_ms_per_layer'] * 1e3:.0f} us "
          f"per layer), median of {args.reps}; Triton launches skipped, GEMMs stubbed")
    if prof is not None:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
        print(out.getvalue())
    if args.output_json:
        from gyrfalcon.bench.common import run_info
        with open(args.output_json, "w") as f:
            json.dump({**run_info(args), "results": res}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
