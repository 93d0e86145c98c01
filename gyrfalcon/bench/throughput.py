"""Offline throughput: many random prompts at once through LLM.generate (ignore_eos, fixed lengths).

Reports requests/s, output tok/s and total tok/s, as `vllm bench throughput` does. --baseline hf
runs transformers' eager generate over the same prompts in batches of --hf-batch-size.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from typing import Optional

from gyrfalcon.bench.common import (BF16_FLOP_PER_S, HBM_BYTES_PER_S, MATMUL_FLOP_PER_S, GCPauses, StepFloor,
                                    add_common_args, busy_span_gaps, format_startup, gaps_by_pair, hf_sampling_kwargs,
                                    print_table, random_prompts, run_info, startup_phases, write_json)
from gyrfalcon.bench.power import PowerSampler, device_uuid, format_summary


def add_cli_args(p: argparse.ArgumentParser) -> None:
    from gyrfalcon.cli import add_engine_args

    add_engine_args(p)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--launch-phases", action="store_true",
                   help="time the host's phases inside each eager step's launch (building the inputs, each "
                        "decoder layer's launches, what follows the forward): where launch() spends or waits")
    p.add_argument("--gpu-timeline", type=int, default=0, metavar="N",
                   help="record the device's kernels over N steps from the first step that runs prompt tokens beside "
                        "decoding sequences (a mixed prefill step): how long the device sat idle between kernels, "
                        "and where")
    p.add_argument("--gpu-timeline-decoders", type=int, default=1, metavar="D",
                   help="the window starts at the first mixed step with at least D decoding sequences")
    p.add_argument("--gpu-timeline-kind", choices=("mixed", "decode"), default="mixed",
                   help="decode: the window starts at a step without prompt tokens instead (at least D decoding "
                        "sequences, launched after --gpu-timeline-after steps): where a decode step's time goes")
    p.add_argument("--gpu-timeline-after", type=int, default=0, metavar="S",
                   help="the window starts no earlier than the run's S-th step")
    add_common_args(p)


def run_gyrfalcon(args) -> dict:
    import torch

    from gyrfalcon.cli import engine_kwargs
    from gyrfalcon.llm import LLM
    from gyrfalcon.sampling_params import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, **engine_kwargs(args))
    startup = time.perf_counter() - t0
    vocab = llm.config.model_config.hf_config.vocab_size
    prompts = [{"prompt_token_ids": p} for p in random_prompts(args.num_prompts, args.input_len, vocab, args.seed)]
    sp = SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    llm.engine.block_manager.reset_prefix_cache()
    runner = llm.engine.runner
    cuda = runner.device.type == "cuda"
    # Every step the run schedules, for the floor its bytes and FLOPs set (StepFloor).
    floor = StepFloor.for_model(runner.model, runner.bytes_per_block // runner.block_size)
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule

    # Host seconds per non-empty step in each phase (schedule, launch, complete: the read-back's wait), in
    # schedule order like floor.step_log; and the garbage collector's pauses inside each phase, charged to the
    # step that phase handles (a full collection walks every live container of the run: requests, their token
    # lists, outputs; on the GPU machine's slow host that could stall a step).
    host = {"schedule": [], "launch": [], "complete": []}
    gc_clock = GCClock(host)

    def counted():
        t0 = time.perf_counter()
        with gc_clock.inside("schedule", len(host["schedule"])):
            batch = schedule()
        if not batch.is_empty:
            host["schedule"].append(time.perf_counter() - t0)
        floor.add(batch)
        return batch
    scheduler.schedule = counted
    launch = runner.launch

    def timed_launch(batch):
        if timeline is not None:
            timeline.before_launch(batch, len(host["launch"]))
        t0 = time.perf_counter()
        if phases is not None:
            phases.begin(t0)
        with gc_clock.inside("launch", len(host["launch"])):
            handle = launch(batch)
        if not batch.is_empty:
            host["launch"].append(time.perf_counter() - t0)
            if phases is not None:
                phases.end(len(host["launch"]) - 1)
        return handle
    runner.launch = timed_launch
    phases = LaunchPhases(runner) if args.launch_phases else None
    timeline = (GpuTimeline(args.gpu_timeline, cuda, args.gpu_timeline_decoders, kind=args.gpu_timeline_kind,
                            after=args.gpu_timeline_after) if args.gpu_timeline > 0 else None)
    # When each non-empty step's tokens came back (StepFloor.by_kind charges the intervals to its steps).
    complete, done = runner.complete, []

    def timed_complete(handle):
        t0 = time.perf_counter()
        with gc_clock.inside("complete", len(done)):
            out = complete(handle)
        if not handle.batch.is_empty:
            done.append(time.perf_counter())
            host["complete"].append(done[-1] - t0)
            if timeline is not None:
                timeline.after_complete(len(done))
        return out
    runner.complete = timed_complete
    before = torch.cuda.memory_stats() if cuda else {}
    if cuda:
        torch.cuda.synchronize()
    # The SM clock and power through the run (nvidia-smi; none on a CPU): the card's 700 W cap slows its clock
    # (started before the clock: nvidia-smi's start and first sample stay out of the timed run)
    sampling = contextlib.ExitStack()
    power = sampling.enter_context(PowerSampler(device_uuid(runner.device) if cuda else None, enabled=cuda))
    t = time.perf_counter()
    try:
        with gc_clock:
            outs = llm.generate(prompts, sp, use_tqdm=False)
        if cuda:
            torch.cuda.synchronize()
        t_end = time.perf_counter()
    finally:
        sampling.close()
        scheduler.schedule = schedule
        del runner.complete, runner.launch  # back to the class's methods
        if phases is not None:
            phases.remove()
        if timeline is not None:
            timeline.stop()
    elapsed = t_end - t
    # The caching allocator's retries (a failed cudaMalloc, all cached blocks freed, which syncs the device,
    # then a second try) and its device allocations during the run: either in a run's steps stalls the host.
    alloc = {}
    if cuda:
        st = torch.cuda.memory_stats()
        alloc = {k: st.get(k, 0) - before.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc",
                                                              "num_device_free", "num_ooms")}
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    return {"engine": "gyrfalcon", "startup_s": startup, "startup_phases": startup_phases(llm, startup),
            "elapsed_s": elapsed,
            "requests_per_s": len(outs) / elapsed, "output_tok_s": n_out / elapsed,
            "total_tok_s": (n_in + n_out) / elapsed, "num_preemptions": llm.engine.scheduler.num_preemptions_total,
            "num_kv_blocks": llm.engine.runner.num_blocks, "floor": floor.report(elapsed),
            "by_kind": floor.by_kind(t, done, {**host, **gc_clock.per_step()}), "gc": gc_clock.summary(),
            "allocator": alloc,
            "launch_phases": phases.by_kind(floor.step_log) if phases is not None else {},
            "gpu_timeline": timeline.report(floor.step_log, host) if timeline is not None else {},
            "gpu_power": power.summary()}


class GpuTimeline:
    """The device's kernels over a window of n steps of the run, from the first step that runs prompt tokens
    beside at least min_decoders decoding sequences (kind "mixed"), or from the first step of only decoding
    sequences, at least min_decoders of them (kind "decode"), launched no earlier than the run's after-th step:
    the busy time (union of kernel intervals), the span from the first kernel to the last, the longest idle gaps
    with the kernels around them, and each kernel's device time a step. A step whose host time exceeds its device
    time shows as gaps; a host that only waits while the device works leaves none. The kernel times say where a
    step's device time goes against the sum of its kernels timed apart. (torch.profiler
    with CUDA activity only: no host-side op recording to slow the host being measured. On a CPU it records CPU
    ops, which checks the plumbing only.)"""

    def __init__(self, n: int, cuda: bool, min_decoders: int = 1, kind: str = "mixed", after: int = 0) -> None:
        if kind not in ("mixed", "decode"):
            raise ValueError(f"timeline kind {kind!r}: mixed or decode")
        self.n, self.cuda, self.min_decoders, self.kind, self.after = n, cuda, max(1, min_decoders), kind, after
        self.first: Optional[int] = None  # launch index of the window's first step
        self.first_decoders = 0
        self.prof = None
        self.events: list = []
        # Steps launched while the profiler ran: with async scheduling the step after the window is launched
        # before the window's last one is read back, so the events hold its kernels too.
        self.profiled_steps = 0

    def before_launch(self, batch, index: int) -> None:
        if self.prof is not None:
            self.profiled_steps += not batch.is_empty
            return
        if self.first is not None or batch.is_empty or index < self.after:
            return
        prompt = any(sr.num_new_tokens > 1 for sr in batch.reqs)
        decoding = sum(1 for sr in batch.reqs if sr.num_new_tokens == 1)
        if prompt == (self.kind == "mixed") and decoding >= self.min_decoders:
            from torch.profiler import ProfilerActivity, profile

            self.first, self.first_decoders = index, decoding
            self.prof = profile(activities=[ProfilerActivity.CUDA if self.cuda else ProfilerActivity.CPU])
            self.prof.start()
            self.profiled_steps = 1

    def after_complete(self, completed: int) -> None:
        """completed: steps read back so far; the window ends when its last step's tokens are back."""
        if self.prof is not None and self.first is not None and completed >= self.first + self.n:
            self.stop()

    def stop(self) -> None:
        if self.prof is None:
            return
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        self.prof.stop()
        want = torch.autograd.DeviceType.CUDA if self.cuda else torch.autograd.DeviceType.CPU
        self.events = sorted((e.time_range.start, e.time_range.end, e.name) for e in self.prof.events()
                             if e.device_type == want)
        self.prof = None

    def report(self, step_log: list, host: dict, top: int = 6, top_kernels: int = 16) -> dict:
        """Times in ms; gaps: [(idle ms, kernel before, kernel after)], longest first."""
        if self.first is None or not self.events:
            return {}
        last = min(self.first + self.n, len(step_log), len(host["launch"]))
        busy, span, gaps = busy_span_gaps(self.events)
        window = range(self.first, last)
        steps = max(1, self.profiled_steps)
        per_kernel: dict = {}
        for start, stop, name in self.events:
            tot = per_kernel.setdefault(name[:80], [0.0, 0])
            tot[0] += (stop - start) / 1e3
            tot[1] += 1
        kernels = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:top_kernels]
        return {"kind": self.kind, "first_step": self.first, "first_step_decoders": self.first_decoders,
                "steps": [step_log[i][0] for i in window],
                "host_launch_ms": [host["launch"][i] * 1e3 for i in window],
                "host_complete_ms": [host["complete"][i] * 1e3 for i in window if i < len(host["complete"])],
                "kernels": len(self.events), "span_ms": span, "busy_ms": busy, "idle_ms": span - busy,
                "idle_gaps_over_0_1ms": sum(1 for g in gaps if g[0] > 0.1),
                "longest_gaps": [[round(g[0], 3), g[1][:60], g[2][:60]] for g in gaps[:top]],
                "profiled_steps": self.profiled_steps, "idle_by_pair": gaps_by_pair(gaps, steps),
                # [name, device ms a step over the profiled steps, launches a step], the most time first
                "top_kernels": [[name, round(ms / steps, 4), round(n / steps, 2)] for name, (ms, n) in kernels]}


class GCClock:
    """The garbage collector's pauses during a run: per generation, and inside the engine's host phases.
    inside(phase, step) marks the host as handling `step` in `phase` (schedule, launch, complete); a pause
    that ends there is charged to gc_<phase> of that step, any other to "elsewhere"."""

    def __init__(self, host: dict) -> None:
        self.host = host
        self.where = None
        self.by_gen: dict = {}
        self.by_phase: dict = {}  # {phase: {step: seconds}}
        self.elsewhere = 0.0
        self._pauses = GCPauses(self._on_pause)

    def _on_pause(self, gen: int, dt: float) -> None:
        g = self.by_gen.setdefault(gen, [0, 0.0])
        g[0] += 1
        g[1] += dt
        if self.where is None:
            self.elsewhere += dt
        else:
            steps = self.by_phase.setdefault(self.where[0], {})
            steps[self.where[1]] = steps.get(self.where[1], 0.0) + dt

    @contextlib.contextmanager
    def inside(self, phase: str, step: int):
        prev, self.where = self.where, (phase, step)
        try:
            yield
        finally:
            self.where = prev

    def __enter__(self):
        self._pauses.__enter__()
        return self

    def __exit__(self, *exc):
        self._pauses.__exit__(*exc)

    def per_step(self) -> dict:
        """{"gc_schedule" / "gc_launch" / "gc_complete": [seconds per step, in step order]}."""
        n = len(self.host["launch"])
        return {f"gc_{ph}": [self.by_phase.get(ph, {}).get(i, 0.0) for i in range(n)]
                for ph in ("schedule", "launch", "complete")}

    def summary(self) -> dict:
        return {"collections": {str(g): c for g, (c, _) in sorted(self.by_gen.items())},
                "ms": {str(g): t * 1e3 for g, (_, t) in sorted(self.by_gen.items())},
                "elsewhere_ms": self.elsewhere * 1e3}


class LaunchPhases:
    """Host timestamps inside the runner's eager launches (steps that replay a graph run no layer forward and
    are not recorded): when the inputs were built, when each decoder layer's forward began, when the model's
    forward ended. A launch whose time sits in one gap waits there (a host-device sync, or a full launch
    queue); spread evenly over the layers, it is the host's own launch cost."""

    def __init__(self, runner) -> None:
        import gyrfalcon.runner.model_runner as mr

        self._mr, self._build = mr, mr.build_forward_batch
        self._model = runner.model
        self._layers = list(runner.model.model.layers)
        self._cur: Optional[dict] = None
        self.steps: dict = {}  # launch index -> record

        mr.build_forward_batch = self._stamped_after(self._build, "built")
        runner.model.forward = self._stamped_after(runner.model.forward, "forward_end")
        runner.model.compute_logits = self._stamped_after(runner.model.compute_logits, "logits_end")
        for layer in self._layers:
            layer.forward = self._stamped(layer.forward)

    def _stamped_after(self, f, key: str):
        """f, recording when it returned as `key` of the launch being timed."""
        def g(*a, **kw):
            out = f(*a, **kw)
            if self._cur is not None:
                self._cur[key] = time.perf_counter()
            return out
        return g

    def _stamped(self, f):
        def g(*a, **kw):
            if self._cur is not None:
                self._cur["layers"].append(time.perf_counter())
            return f(*a, **kw)
        return g

    def begin(self, t0: float) -> None:
        self._cur = {"t0": t0, "layers": []}

    def end(self, index: int) -> None:
        rec, self._cur = self._cur, None
        if rec is not None and rec["layers"] and "built" in rec:
            rec["t1"] = time.perf_counter()
            self.steps[index] = rec

    def remove(self) -> None:
        self._mr.build_forward_batch = self._build
        del self._model.forward, self._model.compute_logits
        for layer in self._layers:
            del layer.forward

    def by_kind(self, step_log: list) -> dict:
        """Mean ms per eager step of each kind (step_log: StepFloor's, in launch order)."""
        out: dict = {}
        for i, rec in self.steps.items():
            if i >= len(step_log):
                continue
            d = out.setdefault(step_log[i][0], {"steps": 0, "build_ms": 0.0, "to_first_layer_ms": 0.0,
                                                "layers_ms": 0.0, "max_gap_ms": 0.0, "after_forward_ms": 0.0,
                                                "lm_head_ms": 0.0,
                                                "gap_layers": {}})
            ts = rec["layers"] + [rec.get("forward_end", rec["layers"][-1])]
            gaps = [b - a for a, b in zip(ts, ts[1:])]
            worst = max(range(len(gaps)), key=gaps.__getitem__)
            d["steps"] += 1
            d["build_ms"] += (rec["built"] - rec["t0"]) * 1e3
            d["to_first_layer_ms"] += (rec["layers"][0] - rec["built"]) * 1e3
            d["layers_ms"] += (ts[-1] - ts[0]) * 1e3
            d["max_gap_ms"] += gaps[worst] * 1e3
            d["after_forward_ms"] += (rec["t1"] - ts[-1]) * 1e3
            # of which: from the forward's end to the LM head's return (the rows' gather and the head's GEMM)
            d["lm_head_ms"] += (rec.get("logits_end", ts[-1]) - ts[-1]) * 1e3
            # The gap after layer i's start is that layer's launches (the last: up to the forward's end).
            d["gap_layers"][worst] = d["gap_layers"].get(worst, 0) + 1
        for d in out.values():
            for k in ("build_ms", "to_first_layer_ms", "layers_ms", "max_gap_ms", "after_forward_ms", "lm_head_ms"):
                d[k] /= d["steps"]
            d["max_gap_layer"] = max(d["gap_layers"], key=d["gap_layers"].get)
            d["gap_layers"] = {str(k): v for k, v in sorted(d["gap_layers"].items())}
        return out


def run_hf_baseline(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if args.dtype == "auto" else getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).cuda().eval()
    vocab = model.config.vocab_size
    prompts = random_prompts(args.num_prompts, args.input_len, vocab, args.seed)
    torch.cuda.synchronize()
    t = time.perf_counter()
    n_out = 0
    for i in range(0, len(prompts), args.hf_batch_size):
        ids = torch.tensor(prompts[i:i + args.hf_batch_size], device="cuda")
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.output_len,
                             min_new_tokens=args.output_len, pad_token_id=0, **hf_sampling_kwargs(args.temperature))
        n_out += (out.shape[1] - ids.shape[1]) * ids.shape[0]
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t
    return {"engine": "hf-eager", "elapsed_s": elapsed, "requests_per_s": len(prompts) / elapsed,
            "output_tok_s": n_out / elapsed, "total_tok_s": (n_out + len(prompts) * args.input_len) / elapsed}


def main(args: argparse.Namespace) -> int:
    results = {"gyrfalcon": run_gyrfalcon(args)}
    if args.baseline == "hf":
        results["baseline"] = run_hf_baseline(args)
    rows = [["", "req/s", "output tok/s", "total tok/s", "elapsed s"]]
    for key, r in results.items():
        rows.append([r["engine"], f"{r['requests_per_s']:.2f}", f"{r['output_tok_s']:.1f}",
                     f"{r['total_tok_s']:.1f}", f"{r['elapsed_s']:.1f}"])
    if "baseline" in results:
        results["ratio_output_tok_s"] = results["gyrfalcon"]["output_tok_s"] / results["baseline"]["output_tok_s"]
        rows.append(["ratio", "", f"{results['ratio_output_tok_s']:.2f}x", "", ""])
    sampling = "greedy" if args.temperature == 0 else f"temperature {args.temperature:g}"
    print(f"throughput: {args.num_prompts} prompts, input {args.input_len}, output {args.output_len}, {sampling}")
    print_table(rows)
    print(format_startup(results["gyrfalcon"]["startup_s"], results["gyrfalcon"]["startup_phases"]))
    fl = results["gyrfalcon"]["floor"]
    print(f"roofline: {fl['steps']} steps reading {fl['bytes_read_gb']:.0f} GB and computing {fl['tflop']:.0f} TFLOP "
          f"need >= {fl['floor_s']:.1f} s on this GPU (HBM {HBM_BYTES_PER_S / 1e12:.2f} TB/s, bf16 "
          f"{BF16_FLOP_PER_S / 1e12:.0f} TFLOP/s): {fl['roofline_fraction']:.1%} of the roofline")
    print(f"serial floor (each step's GEMMs, then its attention; matmuls at {MATMUL_FLOP_PER_S / 1e12:.0f} TFLOP/s): "
          f">= {fl['serial_floor_s']:.1f} s: {fl['serial_floor_fraction']:.1%} of it")
    for kind, d in sorted(results["gyrfalcon"]["by_kind"].items()):
        print(f"  {kind} steps: {d['steps']} ({d['mean_rows']:.0f} sequences on average), {d['wall_s']:.1f} s, "
              f"{d['ms_per_step']:.2f} ms each, floor {d['floor_s']:.1f} s: {d['roofline_fraction']:.1%}")
        if "host_ms_per_step" in d:
            print("    host ms per step: " + ", ".join(f"{k} {v:.2f}" for k, v in d["host_ms_per_step"].items()))
    gcs = results["gyrfalcon"]["gc"]
    print("  garbage collector: " + ", ".join(f"gen {g}: {c} collections, {gcs['ms'][g]:.1f} ms"
                                              for g, c in gcs["collections"].items())
          + f"; {gcs['elsewhere_ms']:.1f} ms outside the engine's phases")
    for kind, d in sorted(results["gyrfalcon"]["launch_phases"].items()):
        print(f"  eager {kind} launches ({d['steps']}), host ms: build inputs {d['build_ms']:.2f}, to the first layer "
              f"{d['to_first_layer_ms']:.2f}, layers {d['layers_ms']:.2f} (the longest one {d['max_gap_ms']:.2f}, "
              f"most often layer {d['max_gap_layer']}), after the forward {d['after_forward_ms']:.2f} (of which to the "
              f"LM head's return {d['lm_head_ms']:.2f})")
    if results["gyrfalcon"].get("gpu_power"):
        print("  " + format_summary(results["gyrfalcon"]["gpu_power"]))
    tl = results["gyrfalcon"]["gpu_timeline"]
    if tl:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted({k: tl["steps"].count(k) for k in tl["steps"]}.items()))
        print(f"  device timeline ({tl['kind']}) over {len(tl['steps'])} steps from step {tl['first_step']} (beside "
              f"{tl['first_step_decoders']} decoders; {kinds}): "
              f"{tl['kernels']} kernels, busy {tl['busy_ms']:.2f} of {tl['span_ms']:.2f} ms, "
              f"idle {tl['idle_ms']:.2f} ms ({tl['idle_gaps_over_0_1ms']} gaps over 0.1 ms)")
        print("    host launch ms: " + ", ".join(f"{x:.1f}" for x in tl["host_launch_ms"])
              + "; complete ms: " + ", ".join(f"{x:.1f}" for x in tl["host_complete_ms"]))
        for ms, a, b in tl["longest_gaps"]:
            print(f"    idle {ms:.3f} ms between {a} and {b}")
        if tl.get("top_kernels"):
            print(f"    kernels a step over the {tl['profiled_steps']} steps launched while profiling:")
        for name, ms, n in tl.get("top_kernels", [])[:12]:
            print(f"    {ms:8.3f} ms a step in {n:g} launches: {name}")
    if results["gyrfalcon"]["allocator"]:
        print("  allocator during the run: " + ", ".join(f"{k} {v}" for k, v in results["gyrfalcon"]["allocator"].items()))
    write_json(args, {"bench": "throughput", **run_info(args), "results": results})
    return 0
