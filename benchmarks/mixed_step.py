"""Where a throughput run's prefill steps go: one step that mixes prompt chunks with many decoding sequences,
profiled by kernel, beside its two halves run alone (the same prompts' prefill with no decoders, and a
decode step of the same decoders).

The throughput row (768 x 1024/1024, bench throughput) spends about a third of its time in ~100 such
steps at ~43% of their floor (run 34, 2026-12-01: 267 ms each for ~7.9k prompt tokens beside ~290
decoders), against ~74% for its decode steps. If the mixed step costs about what its halves cost, the
lever is the GEMMs' rate; if it costs more, the excess is in how the decoders ride along (their
attention runs in the prefill kernel, one query per sequence).

python3 benchmarks/mixed_step.py --model DIR [--decoders 288] [--prompts 8] [--input-len 1024]
    [--max-num-seqs 384] [--sync-debug] [--output-json FILE]
--sync-debug: torch.cuda.set_sync_debug_mode("warn") during the profiled steps, so every operation that
makes the host wait on the device is printed with its stack (bench throughput's prefill steps hold the host
150-240 ms in launch(), run 36).
--cprofile: each profiled step also under cProfile; the functions that held the host longest (own time) are
printed and stored. A wait on the device that the sync debug mode does not see (run 39: none reported while
the mixed step's launch() took 201 ms of its 197 ms on the device) shows up as one C call's own time.
On a CPU (the tests) it profiles CPU ops instead of CUDA kernels, which checks the plumbing only.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from gyrfalcon.bench.common import random_prompts, run_info
from gyrfalcon.bench.latency import prefill_summary
from gyrfalcon.llm import LLM
from gyrfalcon.sampling_params import SamplingParams


SYNC_DEBUG = False  # --sync-debug on a GPU: warn at every host-device sync inside the profiled steps
CPROFILE = False  # --cprofile: the profiled steps under cProfile too


def _top_own_time(prof: cProfile.Profile, n: int = 12) -> list:
    """[(function, calls, own ms, cumulative ms)] of the n functions with the most own time."""
    st = pstats.Stats(prof)
    rows = []
    for (file, line, name), (_, calls, tt, ct, _) in st.stats.items():
        where = name if file == "~" else f"{file.rsplit('/', 2)[-1] if '/' in file else file}:{line}({name})"
        rows.append((where, calls, tt * 1e3, ct * 1e3))
    rows.sort(key=lambda r: -r[2])
    return rows[:n]


def _profiled_step(engine, label: str) -> dict:
    """Run one engine step under the profiler: wall ms (synchronized), device busy / span ms, top kernels."""
    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    if cuda:
        torch.cuda.synchronize()
    schedule, seen = engine.scheduler.schedule, []
    launch, launch_s = engine.runner.launch, []

    def recorded():
        seen.append(schedule())
        return seen[-1]

    def timed_launch(batch):
        t = time.perf_counter()
        handle = launch(batch)
        launch_s.append(time.perf_counter() - t)
        return handle
    engine.scheduler.schedule, engine.runner.launch = recorded, timed_launch
    cprof = cProfile.Profile() if CPROFILE else None
    t0 = time.perf_counter()
    try:
        with profile(activities=acts) as prof:
            if SYNC_DEBUG:
                torch.cuda.set_sync_debug_mode("warn")
            if cprof is not None:
                cprof.enable()
            engine.step()
            if cprof is not None:
                cprof.disable()
            if SYNC_DEBUG:
                torch.cuda.set_sync_debug_mode("default")
            if cuda:
                torch.cuda.synchronize()
    finally:
        del engine.scheduler.schedule, engine.runner.launch  # back to the classes' methods
    wall_ms = (time.perf_counter() - t0) * 1e3
    # What the step held: sequences that decoded one token, and the prompt tokens of the others.
    decode_rows = sum(1 for sr in seen[0].reqs if sr.num_new_tokens == 1)
    prompt_tokens = sum(sr.num_new_tokens for sr in seen[0].reqs if sr.num_new_tokens > 1)
    want = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    evs = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == want
           and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    layer_params = sum(p.numel() for p in engine.runner.model.model.layers.parameters())
    summ = prefill_summary(evs, decode_rows + prompt_tokens, layer_params, top=10)
    out = {"label": label, "decode_rows": decode_rows, "prompt_tokens": prompt_tokens,
           "wall_ms": wall_ms, "launch_ms": launch_s[0] * 1e3, "kernels": len(evs),
           "busy_ms": summ.get("gpu_busy_ms") if cuda else None, "span_ms": summ.get("gpu_span_ms") if cuda else None,
           "top": summ.get("top_kernels", [])}
    busy = f"busy {out['busy_ms']:.2f} ms of a {out['span_ms']:.2f} ms span, " if cuda else ""
    # launch_ms: the host's time to queue the step; near the device's span it means launch() waited on the
    # device (a sync), far below it that the host ran ahead.
    print(f"{label}: {decode_rows} decode rows, {prompt_tokens} prompt tokens; wall {wall_ms:.2f} ms, "
          f"launch {out['launch_ms']:.2f} ms, {busy}{len(evs)} events", flush=True)
    for n, c, ms in out["top"]:
        print(f"    {ms:9.3f} ms {c:5d}x  {n}")
    if cprof is not None:
        out["host_own_time"] = _top_own_time(cprof)
        print("  host functions by own time (cProfile):")
        for where, calls, tt, ct in out["host_own_time"]:
            print(f"    {tt:9.3f} ms own, {ct:9.3f} ms cumulative {calls:6d}x  {where}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--decoders", type=int, default=288)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=384)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sync-debug", action="store_true")
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()

    # Synchronous steps: each profiled step is one launch and its own read-back (async scheduling overlaps the
    # host's bookkeeping with the device, which does not change the kernels a step runs).
    llm = LLM(args.model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              async_scheduling=False)
    engine = llm.engine
    vocab = llm.config.model_config.hf_config.vocab_size
    budget = llm.config.scheduler_config.max_num_batched_tokens
    if args.prompts * args.input_len > budget:
        print(f"--prompts x --input-len ({args.prompts * args.input_len}) exceeds the step's token budget "
              f"({budget}): the prompts would not fit one step", file=sys.stderr)
        return 2
    prompts = random_prompts(args.decoders + 2 * args.prompts + 2, args.input_len, vocab, args.seed)
    warm, fresh_a, fresh_b = prompts[:2], prompts[2:2 + args.prompts], prompts[2 + args.prompts:2 + 2 * args.prompts]
    decoders = prompts[2 + 2 * args.prompts:]
    llm.generate([{"prompt_token_ids": p} for p in warm], SamplingParams(temperature=0, max_tokens=4,
                                                                          ignore_eos=True), use_tqdm=False)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    global SYNC_DEBUG, CPROFILE
    SYNC_DEBUG = args.sync_debug and torch.cuda.is_available()
    CPROFILE = args.cprofile

    # 1. The prompts alone: one prefill step, no decoders.
    for i, p in enumerate(fresh_a):
        engine.add_request(f"alone-{i}", p, one)
    results = {"prefill_alone": _profiled_step(engine, f"prefill alone ({args.prompts} x {args.input_len})")}
    while engine.has_unfinished_requests():
        engine.step()

    # 2. Decoders: prefill them (unprofiled), then one decode step of all of them alone.
    max_new = llm.config.model_config.max_model_len - args.input_len - 8
    long = SamplingParams(temperature=0, max_tokens=max(16, min(512, max_new)), ignore_eos=True)
    for i, p in enumerate(decoders):
        engine.add_request(f"dec-{i}", p, long)
    for _ in range(10_000):  # until every decoder's prompt is in the cache
        engine.step()
        reqs = engine.scheduler.running
        if not engine.scheduler.waiting and all(r.num_computed_tokens >= r.num_prompt_tokens for r in reqs):
            break
    engine.step()  # every decoder has its first token now
    results["decode_alone"] = _profiled_step(engine, f"decode alone ({len(decoders)} sequences)")

    # 3. The other prompts beside the same decoders: one mixed step.
    for i, p in enumerate(fresh_b):
        engine.add_request(f"mixed-{i}", p, one)
    results["mixed"] = _profiled_step(engine, f"mixed ({args.prompts} x {args.input_len} + {len(decoders)} decoders)")
    for r in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        engine.abort_request(r.request_id)
    a, d, m = (results[k]["span_ms"] if torch.cuda.is_available() else results[k]["wall_ms"]
               for k in ("prefill_alone", "decode_alone", "mixed"))
    results["excess_ms"] = m - (a + d)
    print(f"mixed step {m:.2f} ms vs prefill alone {a:.2f} + decode alone {d:.2f} = {a + d:.2f} ms: "
          f"excess {m - a - d:+.2f} ms", flush=True)
    payload = {**run_info(args), "decoders": len(decoders), "prompts": args.prompts, "input_len": args.input_len,
               "token_budget": budget, "results": results}
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"wrote {args.output_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
