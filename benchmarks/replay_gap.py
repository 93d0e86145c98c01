"""Device time between CUDA-graph replays, without the engine: what does a decode step's input copy cost?

Run 104 (`bench latency --step-events`) found the device spending ~0.26 ms between one decode-graph replay's end
and the next one's start at Llama-3.1-8B batch 1, 16 and 64 alike. Between two replays the engine copies the sampled
tokens to pinned host memory, and the next step's inputs to the device on a side stream that waits for the replay to
finish reading them (cuda_graph.side_stream_copies). This measures what those copies cost alone. Run 105: 7-15 us
(32 KB-2 MB of inputs, every mode below) against 1 us back to back; the ~0.26 ms was the LM head and argmax, which
run after the graph (docs/performance.md, runs 104-105).

Here a synthetic graph (a chain of --kernels GEMV-sized matmuls over a weight pool larger than L2, ~3-4 ms) is
replayed --iters times in each mode, events around each replay, the host paced as the engine's async scheduling
paces it (launch N+1 after waiting for N-1's tokens):
  b2b     replays back to back, nothing between
  inline  the input copy (pinned -> device, --copy-kb) and the token copy back in the compute stream
  side    the engine's chain: input copy on a side stream after the last replay's read-done event, the compute
          stream waiting for it; the token copy in the compute stream
  side_early  the same, but the input copy into a second device buffer (double-buffered inputs): it waits for
          nothing, so it can run during the previous replay
  staged  the input copy on the side stream into one of two device staging buffers (waiting only for the copy
          out of that buffer two iterations back), then a device-to-device copy into the input buffer in the
          compute stream right before the replay
The copies write device buffers that the graph does not read: what is timed is their place in the streams and
the events ordering them, as in the engine, not a data dependency (which would not change the device's timing).
Per mode: the mean replay device time, the mean device time between replays, and the per-iteration wall time.

python3 benchmarks/replay_gap.py [--kernels 200] [--copy-kb 32 512 2048] [--iters 100] [--output-json F]
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def build_graph(n_kernels: int, rows: int = 16):
    """A graph of n_kernels matmuls [rows, 4096] @ [4096, 4096]^T over a pool of 16 weights (512 MB: not L2
    resident), starting from x + inp (a static input), -> (graph, inp, out [rows, 1] int64: the "tokens")."""
    dev = torch.device("cuda")
    pool = [torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16) * 0.01 for _ in range(16)]
    inp = torch.zeros(rows, 4096, device=dev, dtype=torch.bfloat16)
    x = torch.randn(rows, 4096, device=dev, dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside the capture (cuBLAS handles, workspaces)
        y = x + inp
        for i in range(3):
            y = torch.mm(y, pool[i].t())
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = x + inp
        for i in range(n_kernels - 1):
            y = torch.mm(y, pool[i % len(pool)].t())
        out = y[:, :1].to(torch.int64)
    return g, inp, out


def run_mode(mode: str, g, inp, out, copy_bytes: int, iters: int) -> dict:
    dev = inp.device
    compute = torch.cuda.current_stream()
    words = max(1, copy_bytes // 8)
    staging = [torch.zeros(words, dtype=torch.int64, pin_memory=True) for _ in range(2)]
    dev_in = [torch.zeros(words, dtype=torch.int64, device=dev) for _ in range(2)]
    host_out = [torch.zeros(out.numel(), dtype=torch.int64, pin_memory=True) for _ in range(2)]
    side = torch.cuda.Stream(dev)
    read_done, copied = torch.cuda.Event(), torch.cuda.Event()
    stage = [torch.zeros(words, dtype=torch.int64, device=dev) for _ in range(2)]
    stage_free = [torch.cuda.Event(), torch.cuda.Event()]  # the D2D copy out of that staging buffer ran
    pairs, done = [], []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for it in range(iters):
        if len(done) >= 2:
            done[-2].synchronize()  # the engine's pacing: step N+1 launches after step N-1's tokens are read
        turn = it % 2
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if mode == "inline":
            dev_in[0].copy_(staging[turn], non_blocking=True)
        elif mode in ("side", "side_early"):
            buf = dev_in[turn] if mode == "side_early" else dev_in[0]
            if mode == "side":
                side.wait_event(read_done)
            with torch.cuda.stream(side):
                buf.copy_(staging[turn], non_blocking=True)
                copied.record(side)
            compute.wait_event(copied)
        elif mode == "staged":
            side.wait_event(stage_free[turn])
            with torch.cuda.stream(side):
                stage[turn].copy_(staging[turn], non_blocking=True)
                copied.record(side)
            compute.wait_event(copied)
            dev_in[0].copy_(stage[turn])
            stage_free[turn].record(compute)
        g.replay()
        read_done.record(compute)
        end.record()
        if mode != "b2b":
            host_out[turn].copy_(out.view(-1), non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        done.append(ev)
        pairs.append((start, end))
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / iters
    replay = [s.elapsed_time(e) for s, e in pairs[5:]]
    gaps = [pairs[i - 1][1].elapsed_time(pairs[i][0]) for i in range(6, len(pairs))]
    return {"mode": mode, "copy_bytes": copy_bytes, "replay_ms": sum(replay) / len(replay),
            "gap_ms": sum(gaps) / len(gaps), "gap_ms_max": max(gaps), "wall_ms": wall * 1e3}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kernels", type=int, default=200)
    p.add_argument("--copy-kb", type=int, nargs="+", default=[32, 512, 2048])
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    g, inp, out = build_graph(args.kernels)
    rows = []
    for kb in args.copy_kb:
        for mode in ("b2b", "inline", "side", "side_early", "staged"):
            if mode == "b2b" and kb != args.copy_kb[0]:
                continue
            r = run_mode(mode, g, inp, out, kb * 1024, args.iters)
            rows.append(r)
            print(f"{mode:10s} copy {kb:5d} KB: replay {r['replay_ms']:.3f} ms, between replays {r['gap_ms']:.3f} ms "
                  f"(max {r['gap_ms_max']:.3f}), wall {r['wall_ms']:.3f} ms an iteration", flush=True)
    if args.output_json:
        from gyrfalcon.bench.common import run_info
        with open(args.output_json, "w") as f:
            json.dump({"bench": "replay_gap", **run_info(args), "gpu": torch.cuda.get_device_name(),
                       "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
