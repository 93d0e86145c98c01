"""Where the host's time goes in a decode step: per-phase wall time and a cProfile of LLM.generate.

A decode step is host-bound when the host's work per step (schedule, fill the graph's inputs, replay,
read the tokens back, update the requests, process the outputs) takes longer than the graph's replay on
the device. `bench latency --profile` shows the symptom (measured step > replay back to back); this
shows the cause. Run on the GPU machine:

    python3 scripts/host_profile.py --model /tmp/ck/q06 --batch-size 1 --output-len 256
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from collections import defaultdict


def _wrap(obj, name: str, acc: dict, key: str) -> None:
    fn = getattr(obj, name)

    def timed(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            acc[key] += time.perf_counter() - t
    setattr(obj, name, timed)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--output-json")
    args = p.parse_args()

    import torch

    from gyrfalcon.bench.common import random_prompts
    from gyrfalcon.llm import LLM
    from gyrfalcon.sampling_params import SamplingParams

    llm = LLM(args.model, max_num_seqs=max(args.batch_size, 1))
    eng, runner = llm.engine, llm.engine.runner
    vocab = llm.config.model_config.hf_config.vocab_size
    inputs = [{"prompt_token_ids": q} for q in random_prompts(args.batch_size, args.input_len, vocab, 0)]
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)

    cuda = runner.device.type == "cuda"

    def run() -> float:
        eng.block_manager.reset_prefix_cache()
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate(inputs, sp, use_tqdm=False)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t

    run()
    plain = min(run() for _ in range(3))

    acc: dict = defaultdict(float)
    _wrap(eng, "step", acc, "engine.step")
    _wrap(eng.scheduler, "schedule", acc, "scheduler.schedule")
    _wrap(eng.scheduler, "update", acc, "scheduler.update")
    _wrap(runner, "launch", acc, "runner.launch")
    _wrap(runner, "complete", acc, "runner.complete")
    if runner.graph_runner is not None:
        _wrap(runner.graph_runner, "run", acc, "graph_runner.run (fill + replay)")
        _wrap(runner.graph_runner.inputs, "fill", acc, "graph inputs.fill")
    # The wait for the device inside complete(): time the host spends idle on the GPU.
    orig_sync = torch.cuda.Event.synchronize

    def sync(ev):
        t = time.perf_counter()
        orig_sync(ev)
        acc["event.synchronize (waiting on the GPU)"] += time.perf_counter() - t
    torch.cuda.Event.synchronize = sync
    wrapped = run()
    torch.cuda.Event.synchronize = orig_sync
    steps = args.output_len
    phases = {k: v / steps * 1e6 for k, v in sorted(acc.items(), key=lambda kv: -kv[1])}

    prof = cProfile.Profile()
    prof.enable()
    profiled = run()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)

    print(f"batch {args.batch_size}, {args.input_len} in / {steps} out: generate {plain * 1e3:.1f} ms "
          f"({plain / steps * 1e6:.0f} us per token step incl. prefill); with phase timers {wrapped * 1e3:.1f} ms; "
          f"under cProfile {profiled * 1e3:.1f} ms")
    print("us per step, by phase (nested phases overlap):")
    for k, v in phases.items():
        print(f"  {v:8.1f}  {k}")
    print(s.getvalue())
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "generate_s": plain, "phases_us_per_step": phases,
                       "cprofile_tottime": s.getvalue()}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
