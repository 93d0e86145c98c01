"""Host time per engine step, without a model: the scheduler, block manager, request bookkeeping and
output processing that every decode step pays on the CPU (on a slow host, this is what a GPU waits on
at small batches), plus the CUDA-graph input fill, all measured on the CPU.

A stand-in runner returns a fixed token at once, so the time per step is pure host work.

Admission (--admission-len N, default 128): the host time from handing a batch of new N-token prompts to the
engine to its prefill step's launch, as LLM.generate runs it (each prompt validated, then added through the
output processor and the engine, then the first step scheduled: the prefix cache's block hashes, the block
allocation). It is spent before the first kernel of a batch's prefill, so it adds to the batch's TTFT: Llama-3.1-8B
b64's TTFT (192 ms, run 99) exceeds its prefill's GPU span (175 ms) by ~17 ms.

python3 benchmarks/host_overhead.py [--batch-sizes 1 16 64] [--steps 256] [--admission-len 128] [--profile]
    [--output-json FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time

import torch

from gyrfalcon.config import EngineConfig
from gyrfalcon.engine.engine import Engine
from gyrfalcon.output_processor import OutputProcessor
from gyrfalcon.sampling_params import SamplingParams


class _Handle:
    def __init__(self, batch):
        self.batch = batch


class _Out:
    def __init__(self, sampled):
        self.sampled, self.logprobs, self.prompt_logprobs = sampled, [None] * len(sampled), None


class InstantRunner:
    """The ModelRunner interface with no model: every scheduled sampling row gets token 7."""

    def __init__(self, num_blocks: int, block_size: int, fill=None):
        self.num_blocks, self.block_size, self.fill = num_blocks, block_size, fill

    def launch(self, batch):
        if self.fill is not None and not batch.is_empty and all(sr.num_new_tokens == 1 for sr in batch.reqs):
            self.fill(batch.reqs)
        return _Handle(batch)

    def complete(self, handle):
        return _Out([7 if sr.sample else None for sr in handle.batch.reqs])

    def execute(self, batch):
        return self.complete(self.launch(batch))


def run(batch_size: int, steps: int, async_scheduling: bool, with_fill: bool, profile: bool, model: str):
    from gyrfalcon.runner.cuda_graph import DecodeInputs, capture_sizes, padded_size
    from gyrfalcon.tokenizer import load_tokenizer

    config = EngineConfig.create(model=model, max_num_seqs=max(batch_size, 1), device="cpu",
                                 async_scheduling=async_scheduling, max_model_len=2048)
    tok = load_tokenizer(config.model_config.tokenizer_path)
    fill = None
    if with_fill:
        sizes = capture_sizes(batch_size)
        inputs = DecodeInputs(sizes[-1], 2048 // 16, torch.device("cpu"))
        last_rows = {}

        def fill(reqs):
            for i, sr in enumerate(reqs):
                last_rows[sr.request.request_id] = i
            inputs.fill(reqs, padded_size(sizes, len(reqs)), 16, last_rows)
    runner = InstantRunner(num_blocks=batch_size * 2048 // 16 + 16, block_size=16, fill=fill)
    engine = Engine(config, [tok.eos_token_id], runner=runner)
    proc = OutputProcessor(tok, defer_text=True)  # as LLM.generate (the latency benchmark) runs it
    sp = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    for i in range(batch_size):
        rid = f"r{i}"
        for eid, params in proc.add_request(rid, None, list(range(100, 228)), sp):
            engine.add_request(eid, list(range(100, 228)), params)
    engine.step()  # prefill
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    for _ in range(steps):
        proc.process(engine.step())
    if prof:
        prof.disable()
    dt = (time.perf_counter() - t0) / steps
    if prof:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    return dt


def admission(batch_size: int, input_len: int, model: str, reps: int = 21, profile: bool = False) -> float:
    """Median seconds from submitting batch_size new prompts of input_len tokens to their prefill's launch."""
    from gyrfalcon.tokenizer import load_tokenizer

    max_len = max(2048, 2 * input_len)
    config = EngineConfig.create(model=model, max_num_seqs=max(batch_size, 1), device="cpu", max_model_len=max_len,
                                 max_num_batched_tokens=max(batch_size * input_len, max_len))
    tok = load_tokenizer(config.model_config.tokenizer_path)
    runner = InstantRunner(num_blocks=batch_size * max_len // 16 + 16, block_size=16)
    engine = Engine(config, [tok.eos_token_id], runner=runner)
    vocab = config.model_config.hf_config.vocab_size
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times = []
    prof = cProfile.Profile() if profile else None
    for rep in range(reps):
        # distinct prompts each rep (no prefix-cache hit), in the vocabulary
        prompts = [[(rep * 7919 + i * 104729 + j * 31) % vocab for j in range(input_len)] for i in range(batch_size)]
        proc = OutputProcessor(tok, defer_text=True)
        if prof and rep == reps - 1:
            prof.enable()
        t0 = time.perf_counter()
        for ids in prompts:  # LLM.generate validates every prompt before submitting any
            engine.validate_prompt(ids)
            engine.validate_params(sp)
        for i, ids in enumerate(prompts):
            for eid, params in proc.add_request(f"a{rep}-{i}", None, ids, sp):
                engine.add_request(eid, ids, params)
        engine.step()  # schedules and "launches" the prefill
        times.append(time.perf_counter() - t0)
        if prof and rep == reps - 1:
            prof.disable()
        while engine.has_unfinished_requests():
            proc.process(engine.step())
    if prof:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(20)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--model", default=None, help="tokenizer source (default: the demo model)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--admission-len", type=int, default=128, help="prompt tokens of the admission timing (0: skip)")
    ap.add_argument("--output-json")
    args = ap.parse_args()
    from gyrfalcon.config import default_model_path

    model = args.model or default_model_path()
    print(f"{'batch':>5} {'mode':>6} {'fill':>5} {'us/step':>9} {'us/step/seq':>12}")
    rows = []
    for b in args.batch_sizes:
        for async_scheduling in (False, True):
            for with_fill in (False, True):
                dt = run(b, args.steps, async_scheduling, with_fill, args.profile and async_scheduling and with_fill,
                         model)
                print(f"{b:5d} {'async' if async_scheduling else 'sync':>6} {str(with_fill):>5} {dt * 1e6:9.1f} "
                      f"{dt * 1e6 / b:12.2f}", flush=True)
                rows.append({"batch": b, "async_scheduling": async_scheduling, "graph_input_fill": with_fill,
                             "us_per_step": round(dt * 1e6, 2)})
    if args.admission_len:
        print(f"{'batch':>5} {'admission us':>13} ({args.admission_len}-token prompts, to the prefill's launch)")
        for b in args.batch_sizes:
            dt = admission(b, args.admission_len, model, profile=args.profile)
            print(f"{b:5d} {dt * 1e6:13.1f}", flush=True)
            rows.append({"batch": b, "admission_len": args.admission_len, "admission_us": round(dt * 1e6, 2)})
    if args.output_json:
        from gyrfalcon.bench.common import run_info

        info = run_info(args)
        info["command"] = "python3 benchmarks/host_overhead.py " + " ".join(sys.argv[1:])
        with open(args.output_json, "w") as f:
            json.dump({"benchmark": "host_overhead", **info, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
