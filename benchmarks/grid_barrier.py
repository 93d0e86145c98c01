"""What a dependency between two phases of a decode step costs on the GPU: a kernel boundary inside a CUDA
graph (plain, and with programmatic dependent launch) against a software grid barrier inside one
persistent kernel (one program per SM, an arrival counter, a spin on it).

A batch-1 decode layer is five dependent phases (qkv, attention, o_proj, gate_up, down); at Qwen3-0.6B's
size each moves 1-3 us of weight bytes but costs ~4 us as its own kernel (benchmarks/results, run 27).
If a grid barrier costs well under a kernel boundary, a persistent per-layer (or per-step) kernel is the
lever left for the batch-1 rows; if not, it is not. Each variant runs ROUNDS dependent steps of the same
tiny work (every program adds its id to a running value and stores it), so what differs is the cost of
the dependency itself.

python3 benchmarks/grid_barrier.py [--rounds 2000] [--output-json FILE]   (GPU only: the spin needs every
program resident at once, which the Triton interpreter, running programs one by one, never gives)
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl

from gyrfalcon.bench.common import run_info
from gyrfalcon.kernels._common import gdc_launch_dependents, gdc_wait
from small_m_gemv import graph_time_us  # a sibling script (benchmarks/ is sys.path[0] when run as one)


@triton.jit
def _step_kernel(buf_ptr, USE_PDL: tl.constexpr):
    # One dependent step: read what the previous step wrote, write the next value.
    pid = tl.program_id(0)
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    v = tl.load(buf_ptr + pid)
    tl.store(buf_ptr + pid, v + pid + 1)


@triton.jit
def _persistent_kernel(buf_ptr, counter_ptr, rounds, NPROG: tl.constexpr):
    # Every program runs all rounds; between rounds all programs meet at a barrier: arrive (release), then
    # spin on the counter (volatile loads) until every program of this round has arrived.
    pid = tl.program_id(0)
    for r in range(rounds):
        v = tl.load(buf_ptr + pid, volatile=True)
        tl.store(buf_ptr + pid, v + pid + 1)
        tl.debug_barrier()
        tl.atomic_add(counter_ptr, 1, sem="release")
        target = (r + 1) * NPROG
        seen = tl.load(counter_ptr, volatile=True)
        while seen < target:
            seen = tl.load(counter_ptr, volatile=True)
        tl.debug_barrier()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--output-json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    n = torch.cuda.get_device_properties(0).multi_processor_count
    buf = torch.zeros(n, dtype=torch.float32, device="cuda")
    res = {"programs": n, "rounds": args.rounds}
    # One graph of `rounds` dependent launches: its time per call is the time per step.
    res["kernel_boundary_us"] = graph_time_us([lambda: _step_kernel[(n,)](buf, USE_PDL=False, num_warps=4)],
                                              reps=args.rounds)
    if gdc_wait is not None and torch.cuda.get_device_capability()[0] >= 9:
        res["kernel_boundary_pdl_us"] = graph_time_us(
            [lambda: _step_kernel[(n,)](buf, USE_PDL=True, num_warps=4, launch_pdl=True)], reps=args.rounds)
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    _persistent_kernel[(n,)](buf, counter, 10, NPROG=n, num_warps=4)  # compile, and check it returns
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        counter.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _persistent_kernel[(n,)](buf, counter, args.rounds, NPROG=n, num_warps=4)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / args.rounds)
        assert int(counter.item()) == n * args.rounds
    res["grid_barrier_us"] = sorted(times)[2]
    for k in ("kernel_boundary_us", "kernel_boundary_pdl_us", "grid_barrier_us"):
        if k in res:
            print(f"{k:24s} {res[k]:7.3f} us per dependent step ({n} programs)")
    if args.output_json:
        info = run_info(args)
        info["command"] = "python3 benchmarks/grid_barrier.py " + " ".join(sys.argv[1:])
        with open(args.output_json, "w") as f:
            json.dump({"benchmark": "grid_barrier", **info, "results": res}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
