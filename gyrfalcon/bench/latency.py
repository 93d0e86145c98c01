"""Latency of one batch: TTFT, ms per decode step, output tok/s and the fraction of the HBM roofline.

The roofline of a decode step is the bytes it must read (every weight once, as GPU.md counts it,
plus the KV cache of every sequence) divided by the HBM bandwidth. GPU.md's count includes an untied
embedding table, of which a step only gathers its batch's rows: the read roofline (roofline_read_fraction)
counts the weights a step does read (common.step_weight_bytes: the layers, the final norm, the LM head), so it is
the stricter figure (Llama-3.1-8B: 15.01 of 16.06 GB); of an MoE layer's routed experts it counts those the
batch's tokens select (top_k at batch 1; common.experts_touched). --profile counts CUDA kernel
launches per decode step and per decoder layer with torch.profiler. --baseline hf runs Hugging Face
transformers (static cache + torch.compile) on the same checkpoint in the same process. --compare-unfused runs
the same benchmark with GYRFALCON_DISABLE_FUSION=1 in a child process (envs are read once per process) before the
fused one and reports both side by side: fused vs unfused from one command on one machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gyrfalcon import envs
from gyrfalcon.bench.common import (HBM_BYTES_PER_S, GCPauses, add_common_args, busy_span_gaps, format_startup,
                                    experts_touched, gaps_by_pair, hf_sampling_kwargs, moe_blocks, print_table,
                                    random_prompts, run_info, startup_phases, step_weight_bytes, write_json)
from gyrfalcon.bench.power import PowerSampler, device_uuid, format_summary
from gyrfalcon.bench.step_events import StepEvents, format_step_events
from gyrfalcon.bench.ttft_timeline import format_timeline, ttft_timeline


def add_cli_args(p: argparse.ArgumentParser) -> None:
    from gyrfalcon.cli import add_engine_args

    add_engine_args(p)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-iters-warmup", type=int, default=1)
    p.add_argument("--num-iters", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="count CUDA kernel launches per decode step")
    p.add_argument("--ttft-timeline", action="store_true",
                   help="profile one TTFT generate's host and device timeline (implied by --profile on a GPU)")
    p.add_argument("--compare-unfused", action="store_true",
                   help="also run the same benchmark with GYRFALCON_DISABLE_FUSION=1 (separate norm / RoPE / "
                        "cache-write launches: the unfused layers, e.g. MLA's prep) in a subprocess first; report both")
    p.add_argument("--step-events", action="store_true",
                   help="time each decode-graph replay inside the timed runs with CUDA events, and the graph "
                        "replayed back to back at the runs' middle context")
    add_common_args(p)


def weight_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def kv_bytes_per_token(runner) -> int:
    return runner.bytes_per_block // runner.block_size


def _device_events(prof) -> tuple:
    """A torch.profiler run's CUDA activity: (every event, copies and memsets included; the kernels alone)."""
    import torch

    device = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return device, [e for e in device if "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]


# Kernel name pieces -> the op a launch belongs to (first match wins, case-insensitive): gyrfalcon's Triton kernels
# by their jit function names (kernels/), cuBLAS / CUTLASS GEMMs, and torch's own kernels (the MoE router's softmax
# / top-k / normalization run as those: each is a launch a fused router would remove).
KERNEL_OPS = (
    ("moe_sort", ("_moe_align",)), ("moe_gate_up", ("_moe_gate_up",)), ("moe_down", ("_moe_down",)),
    ("moe_sum", ("_moe_sum",)), ("fp8_gemm", ("_fp8_gemm",)), ("norm_gemv", ("_norm_gemv",)),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas")),
    # MLA's fused prep (kernels/mla_prep) and DeepSeek-V3.2's indexer scores, ahead of attention's broad pieces.
    ("mla_prep", ("_mla_kv_prep", "_mla_q_prep", "_mla_v_proj")), ("dsa_indexer", ("_indexer_scores",)),
    ("attention", ("_decode_", "_paged_prefill", "_mla_prefill", "attn", "flash")), ("qkv_prep", ("_qkv_prep",)),
    ("rms_norm", ("_rms_norm",)), ("rotary", ("_rotary",)), ("store_kv", ("_store_kv",)),
    ("activation", ("_silu_and_mul",)), ("embedding", ("_embedding",)),
    ("sampling", ("_argmax", "_gumbel")),
    ("torch_topk_sort", ("topk", "sort", "bitonic", "radix")), ("torch_softmax", ("softmax",)),
    ("torch_other", ("elementwise", "reduce", "scatter", "gather", "index", "vectorized", "cat")),
)


def kernel_op(name: str) -> str:
    """The KERNEL_OPS op of a CUDA kernel's name, or "other"."""
    low = name.lower()
    for op, pieces in KERNEL_OPS:
        if any(p in low for p in pieces):
            return op
    return "other"


def count_launches(llm, prompts, steps: int = 8, temperature: float = 0.0) -> dict:
    """CUDA kernels per decode step (and per layer), from a profiled run of `steps` decode steps."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from gyrfalcon.sampling_params import SamplingParams

    engine = llm.engine
    sp = SamplingParams(temperature=temperature, max_tokens=steps + 2, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"prof-{i}", p, sp)
    engine.step()  # prefill
    engine.step()  # first decode (lazy init outside the profile)
    torch.cuda.synchronize()
    # (the CPU activity where there is no GPU: the tests run this plumbing on the CPU, kernels none)
    acts = [ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished_requests():
        engine.step()
    device, kernels = _device_events(prof)
    per_step = len(kernels) / steps
    layers = llm.config.model_config.hf_config.num_hidden_layers
    names, times = {}, {}
    for e in kernels:
        names[e.name] = names.get(e.name, 0) + 1
        times[e.name] = times.get(e.name, 0.0) + e.time_range.elapsed_us()
    top = sorted(names.items(), key=lambda kv: -times[kv[0]])[:16]
    busy_us = sum(times.values()) / steps
    # Wall span of the profiled steps on the GPU: busy time well below it means the GPU waited on the host.
    span_us = (max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)) / steps \
        if kernels else 0.0
    # The device's idle time between its busy stretches (copies count as busy: a copy in the compute stream
    # is time no kernel runs, but not idle), summed by the pair of activities around each gap.
    union_ms, _, gaps = busy_span_gaps(sorted((e.time_range.start, e.time_range.end, e.name) for e in device))
    by_op: dict = {}
    for n, c in names.items():
        d = by_op.setdefault(kernel_op(n), [0.0, 0.0])
        d[0] += c / steps
        d[1] += times[n] / steps
    return {"kernels_per_step": per_step, "kernels_per_layer": per_step / layers,
            # {op: [launches per step, GPU us per step]}, by KERNEL_OPS: what each part of a layer costs in launches
            "kernels_by_op": dict(sorted(by_op.items(), key=lambda kv: -kv[1][1])),
            "gpu_busy_us_per_step": busy_us, "gpu_span_us_per_step": span_us,
            "gpu_busy_union_us_per_step": union_ms * 1e3 / steps,
            "idle_by_pair": gaps_by_pair(gaps, steps),
            "top_kernels": [[n[:80], c / steps, times[n] / steps] for n, c in top]}


def profile_prefill(llm, prompts) -> dict:
    """Kernels of one prefill step of `prompts` (every prompt in one step when max_num_batched_tokens
    allows): GPU busy and span, the top kernels by time, and the GEMM-rate it implies (2 x the layers'
    weights x prompt tokens / span). Where TTFT goes, next to the compute bound."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from gyrfalcon.sampling_params import SamplingParams

    engine = llm.engine
    engine.block_manager.reset_prefix_cache()
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"prefill-prof-{i}", p, sp)
    torch.cuda.synchronize()
    # (the CPU activity where there is no GPU: the tests run this plumbing on the CPU, kernels none)
    acts = [ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished_requests():
        engine.step()
    engine.block_manager.reset_prefix_cache()
    _, kernels = _device_events(prof)
    layer_params = sum(p.numel() for p in llm.engine.runner.model.model.layers.parameters())
    return prefill_summary([(e.name, e.time_range.start, e.time_range.end) for e in kernels],
                           sum(len(p) for p in prompts), layer_params)


def prefill_summary(kernels, tokens: int, layer_params: int, top: int = 12) -> dict:
    """kernels: [(name, start us, end us)] of one prefill step -> profile_prefill's dict ({} if none)."""
    if not kernels:
        return {}
    times, counts = {}, {}
    for name, start, end in kernels:
        times[name] = times.get(name, 0.0) + (end - start)
        counts[name] = counts.get(name, 0) + 1
    span_us = max(k[2] for k in kernels) - min(k[1] for k in kernels)
    flop = 2 * layer_params * tokens
    names = sorted(times, key=lambda n: -times[n])[:top]
    return {"tokens": tokens, "kernels": len(kernels), "gpu_busy_ms": sum(times.values()) / 1e3,
            "gpu_span_ms": span_us / 1e3, "layer_tflop": flop / 1e12,
            "layer_tflop_per_s_over_span": flop / (span_us * 1e-6) / 1e12 if span_us > 0 else 0.0,
            "top_kernels": [[n[:80], counts[n], times[n] / 1e3] for n in names]}


def _decode_graph(runner, batch_size: int):
    """(graph runner, captured size) that a decode step of batch_size replays; None without one."""
    gr = getattr(runner, "graph_runner", None)
    if gr is None or not getattr(gr, "graphs", None):
        return None
    size = min((b for b in gr.sizes if b >= batch_size), default=None)
    return None if size is None else (gr, size)


def replay_only_ms(runner, batch_size: int, iters: int = 200) -> float | None:
    """Device time of one decode step's CUDA graph replayed back to back (no host work between replays):
    the floor that host/device overlap can reach. None without graphs."""
    found = _decode_graph(runner, batch_size)
    return None if found is None else _replay_ms(found[0].graphs[(found[1], 1)], iters)


REPLAY_CONTEXTS = (0, 128, 256, 1024, 4096, 8192)


def replay_at_contexts(runner, batch_size: int, contexts=REPLAY_CONTEXTS, iters: int = 200,
                       short: bool = False) -> dict:
    """{context: ms} for the decode graph replayed back to back with every row's static inputs set to
    one token at that context (blocks 0.. of the cache, contents whatever the bench left there): how
    the step's device time grows with the context, i.e. what decode attention costs in the real graph.
    Context 0 is what the startup PDL timing sees (seq_len 0: attention reads nothing). short: the
    one-split graph of that size instead (the backend's graph_variants), at the contexts it serves. Call
    only when the engine is idle: it writes one K/V slot per row of the cache blocks it points at."""
    found = _decode_graph(runner, batch_size)
    if found is None:
        return {}
    gr, size = found
    graph = gr.short_graphs.get(size) if short else gr.graphs[(size, 1)]
    if graph is None:
        return {}
    out = {}
    for ctx in contexts:
        if short and ctx > gr.short_limits.get(size, 0):
            continue
        if gr.inputs.set_context(size, ctx, runner.block_size, runner.num_blocks):
            out[ctx] = _replay_ms(graph, iters)
    gr.inputs.set_context(size, 0, runner.block_size)
    return out


def _replay_ms(graph, iters: int) -> float:
    import torch

    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


class StepClock:
    """Where a generate's wall time goes between its engine steps: the host time at which each
    `engine.step()` returns, and the time the cyclic garbage collector ran, over the runs it watches.

    With async scheduling a step returns once the step before it is done on the device, so in steady
    state the interval between returns is the device's step time plus any stall; comparing the median
    interval with the graph replayed back to back, and summing the intervals' excess over the median
    (GC pauses, the first steps, the end), says what the e2e step time carries beyond the graph.
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self.runs: list = []  # per watched run: (start, [step return times], end, gc seconds by generation)

    def watch(self, fn):
        """Run fn() with every engine step timed; return what fn returns."""
        steps: list = []
        gcs: dict = {}
        self.runs.append([time.perf_counter(), steps, None, gcs])
        inner = self.engine.step

        def step():
            out = inner()
            steps.append(time.perf_counter())
            return out

        def on_pause(gen: int, seconds: float) -> None:
            gcs[gen] = gcs.get(gen, 0.0) + seconds

        self.engine.step = step
        try:
            with GCPauses(on_pause):
                return fn()
        finally:
            del self.engine.step  # back to the class's method
            self.runs[-1][2] = time.perf_counter()

    def summary(self, run: int) -> dict:
        """Milliseconds: the first intervals (start to step 1 is the prefill's launch), the steady
        median / p90 / max, the summed excess of the steady intervals over their median, the tail from
        the last step to the end of generate, and the GC time by generation."""
        start, steps, end, gcs = self.runs[run]
        if len(steps) < 4:
            return {}
        iv = [(b - a) * 1e3 for a, b in zip([start] + steps[:-1], steps)]
        steady = sorted(iv[3:-1]) or sorted(iv)
        med = steady[len(steady) // 2]
        return {
            "steps": len(steps), "first_intervals_ms": [round(x, 3) for x in iv[:3]],
            "median_ms": med, "p90_ms": steady[int(0.9 * (len(steady) - 1))], "max_ms": steady[-1],
            "steady_excess_ms": sum(x - med for x in iv[3:-1] if x > med),
            "last_interval_ms": iv[-1], "tail_ms": (end - steps[-1]) * 1e3,
            "gc_ms": {str(g): t * 1e3 for g, t in sorted(gcs.items())},
        }


def run_gyrfalcon(args) -> dict:
    import torch

    from gyrfalcon.cli import engine_kwargs
    from gyrfalcon.engine.spec_stats import spec_decode_summary
    from gyrfalcon.llm import LLM
    from gyrfalcon.sampling_params import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, **engine_kwargs(args))
    startup = time.perf_counter() - t0
    runner = llm.engine.runner
    vocab = llm.config.model_config.hf_config.vocab_size
    prompts = random_prompts(args.batch_size, args.input_len, vocab, args.seed)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    cuda = runner.device.type == "cuda"

    clock = StepClock(llm.engine)
    events = StepEvents(runner) if args.step_events else None

    def timed(max_tokens: int, watch: bool = False) -> float:
        sp = SamplingParams(temperature=args.temperature, max_tokens=max_tokens, ignore_eos=True)
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        gen = lambda: llm.generate(inputs, sp, use_tqdm=False)  # noqa: E731
        watched = gen if events is None else (lambda: events.watch(gen))
        outs = clock.watch(watched) if watch else gen()
        if cuda:
            torch.cuda.synchronize()
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
        return time.perf_counter() - t

    for _ in range(args.num_iters_warmup):
        timed(args.output_len)
    # Prefix caching would turn the repeated prompt into a cache hit; TTFT must be a real prefill.
    llm.engine.block_manager.reset_prefix_cache()
    ttfts, totals = [], []
    spec0 = llm.engine.spec_stats.as_dict()
    # The SM clock and power while timed (nvidia-smi; none on a CPU): the card's power cap slows its clock
    with PowerSampler(device_uuid(runner.device) if cuda else None, enabled=cuda) as power:
        for _ in range(args.num_iters):
            llm.engine.block_manager.reset_prefix_cache()
            ttfts.append(timed(1))
            llm.engine.block_manager.reset_prefix_cache()
            totals.append(timed(args.output_len, watch=True))
    spec = spec_decode_summary(spec0, llm.engine.spec_stats.as_dict())
    ttft = sorted(ttfts)[len(ttfts) // 2]
    median_run = sorted(range(len(totals)), key=totals.__getitem__)[len(totals) // 2]
    total = totals[median_run]
    step_s = (total - ttft) / max(args.output_len - 1, 1)
    wbytes = weight_bytes(runner.model)
    avg_ctx = args.input_len + args.output_len / 2
    kvbytes = int(args.batch_size * avg_ctx * kv_bytes_per_token(runner))
    roof_step = (wbytes + kvbytes) / HBM_BYTES_PER_S
    read_wbytes = step_weight_bytes(runner.model, args.batch_size)
    read_roof_step = (read_wbytes + kvbytes) / HBM_BYTES_PER_S
    res = {
        "engine": "gyrfalcon", "startup_s": startup, "startup_phases": startup_phases(llm, startup),
        "load_s": runner.load_seconds,
        "graph_capture_s": runner.graph_runner.capture_seconds if runner.graph_runner else 0.0,
        "pdl_choice": dict(runner.graph_runner.pdl_choice) if runner.graph_runner else {},
        "ttft_ms": ttft * 1e3, "decode_step_ms": step_s * 1e3, "e2e_s": total,
        "output_tok_s": args.batch_size * args.output_len / total,
        "decode_tok_s": args.batch_size / step_s,
        "weight_bytes": wbytes, "kv_bytes_per_step": kvbytes,
        "roofline_step_ms": roof_step * 1e3, "roofline_fraction": roof_step / step_s,
        "read_weight_bytes": read_wbytes, "read_roofline_step_ms": read_roof_step * 1e3,
        "roofline_read_fraction": read_roof_step / step_s,
        "num_kv_blocks": runner.num_blocks,
        # Routed experts a step reads per MoE layer, as read_weight_bytes counts them (None: a dense model).
        "moe_experts_read_per_layer": next((experts_touched(E, k, args.batch_size)
                                            for _, _, E, k in moe_blocks(runner.model)), None),
        "step_clock": clock.summary(median_run),
        "fusion": not envs.get().disable_fusion,
        "gpu_power": power.summary(),
    }
    if spec is not None:
        res["spec_decode"] = spec
    # The decode rate at the median run's steady step interval: unlike decode_tok_s it does not subtract a TTFT
    # timed in other generates (those vary by milliseconds within one call).
    sc = res["step_clock"]
    if sc.get("median_ms"):
        res["steady_decode_tok_s"] = args.batch_size / (sc["median_ms"] * 1e-3)
        res["steady_roofline_read_fraction"] = read_roof_step / (sc["median_ms"] * 1e-3)
    if args.profile and cuda:
        res["profile"] = count_launches(llm, prompts[: args.batch_size], temperature=args.temperature)
        res["graph_replay_ms"] = replay_only_ms(runner, args.batch_size)
        res["graph_replay_ms_at_context"] = replay_at_contexts(runner, args.batch_size)
        res["short_graph_replay_ms_at_context"] = replay_at_contexts(runner, args.batch_size, short=True)
        res["prefill_profile"] = profile_prefill(llm, prompts[: args.batch_size])
        # Those replays wrote into cache blocks that prefix caching may still map: forget them.
        llm.engine.block_manager.reset_prefix_cache()
    if events is not None and events.enabled:
        res["step_events"] = events.summary(median_run)
        # The same graph back to back, at the timed runs' middle context (the main and the one-split graph)
        mid = args.input_len + args.output_len // 2
        res["step_events_back_to_back_ms"] = {
            f"main@{c}": ms for c, ms in replay_at_contexts(runner, args.batch_size, (mid,)).items()}
        res["step_events_back_to_back_ms"].update({
            f"short@{c}": ms for c, ms in replay_at_contexts(runner, args.batch_size, (mid,), short=True).items()})
        llm.engine.block_manager.reset_prefix_cache()
    if args.ttft_timeline or (args.profile and cuda):
        res["ttft_timeline"] = ttft_timeline(llm, prompts[: args.batch_size], args.temperature)
    return res


def run_hf_baseline(args) -> dict:
    """transformers generate with a static cache and torch.compile: its best latency setting."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if args.dtype == "auto" else getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).cuda().eval()
    model.generation_config.cache_implementation = "static"
    compiled = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)

    def forward(*a, **kw):
        # Each call is a new CUDA-graph step: generate writes the static cache from the last call's outputs,
        # which torch would otherwise see as reading a graph output that a later replay overwrote.
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(*a, **kw)
    model.forward = forward
    vocab = model.config.vocab_size
    ids = torch.tensor(random_prompts(args.batch_size, args.input_len, vocab, args.seed), device="cuda")
    attn = torch.ones_like(ids)

    def timed(n: int) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=attn, max_new_tokens=n, min_new_tokens=n, pad_token_id=0,
                             **hf_sampling_kwargs(args.temperature))
        torch.cuda.synchronize()
        assert out.shape[1] == ids.shape[1] + n
        return time.perf_counter() - t

    for _ in range(max(args.num_iters_warmup, 2)):  # compile happens here
        timed(args.output_len)
    ttft = sorted(timed(1) for _ in range(args.num_iters))[args.num_iters // 2]
    total = sorted(timed(args.output_len) for _ in range(args.num_iters))[args.num_iters // 2]
    step_s = (total - ttft) / max(args.output_len - 1, 1)
    return {"engine": "hf-static-compile", "ttft_ms": ttft * 1e3, "decode_step_ms": step_s * 1e3,
            "e2e_s": total, "output_tok_s": args.batch_size * args.output_len / total,
            "decode_tok_s": args.batch_size / step_s}


def run_unfused(args) -> dict:
    """run_gyrfalcon's results with GYRFALCON_DISABLE_FUSION=1, from a child process (this module's __main__) given
    the same arguments. It runs before the fused engine exists, so the two never share the GPU's memory."""
    import gyrfalcon

    plain = {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, list, type(None)))}
    env = dict(os.environ, GYRFALCON_DISABLE_FUSION="1")
    root = str(Path(gyrfalcon.__file__).resolve().parents[1])  # this tree's gyrfalcon, whatever the cwd
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    with tempfile.TemporaryDirectory() as tmp:
        a, out = Path(tmp) / "args.json", Path(tmp) / "unfused.json"
        a.write_text(json.dumps(plain))
        subprocess.run([sys.executable, "-m", "gyrfalcon.bench.latency", str(a), str(out)], env=env, check=True)
        return json.loads(out.read_text())


def _print_fused_vs_unfused(g: dict, u: dict) -> None:
    rows = [["", "TTFT ms", "ms/step", "decode tok/s", "kernels/layer"]]
    for name, r in (("fused", g), ("unfused", u)):
        k = (r.get("profile") or {}).get("kernels_per_layer")
        rows.append([name, f"{r['ttft_ms']:.2f}", f"{r['decode_step_ms']:.3f}", f"{r['decode_tok_s']:.1f}",
                     f"{k:.2f}" if k is not None else "-"])
    print("fused vs unfused (GYRFALCON_DISABLE_FUSION=1, a child process of this run):")
    print_table(rows)


def main(args: argparse.Namespace) -> int:
    unfused = run_unfused(args) if getattr(args, "compare_unfused", False) else None
    results = {"gyrfalcon": run_gyrfalcon(args)}
    if unfused is not None:
        results["unfused"] = unfused
        g = results["gyrfalcon"]
        results["fused_vs_unfused"] = {
            "ttft_ratio": unfused["ttft_ms"] / g["ttft_ms"],
            "decode_step_ratio": unfused["decode_step_ms"] / g["decode_step_ms"] if g["decode_step_ms"] > 0 else None}
    if args.baseline == "hf":
        import gc

        import torch
        gc.collect()
        torch.cuda.empty_cache()
        results["baseline"] = run_hf_baseline(args)
    g = results["gyrfalcon"]
    rows = [["", "TTFT ms", "ms/step", "out tok/s", "decode tok/s", "roofline", "read roofline"],
            ["gyrfalcon", f"{g['ttft_ms']:.2f}", f"{g['decode_step_ms']:.3f}", f"{g['output_tok_s']:.1f}",
             f"{g['decode_tok_s']:.1f}", f"{g['roofline_fraction']:.1%}", f"{g['roofline_read_fraction']:.1%}"]]
    if "baseline" in results:
        b = results["baseline"]
        rows.append(["hf static+compile", f"{b['ttft_ms']:.2f}", f"{b['decode_step_ms']:.3f}",
                     f"{b['output_tok_s']:.1f}", f"{b['decode_tok_s']:.1f}",
                     f"{g['roofline_step_ms'] / b['decode_step_ms']:.1%}",
                     f"{g['read_roofline_step_ms'] / b['decode_step_ms']:.1%}"])
        results["ratio_output_tok_s"] = g["output_tok_s"] / b["output_tok_s"]
        rows.append(["ratio", "", "", f"{results['ratio_output_tok_s']:.2f}x", "", "", ""])
    sampling = "greedy" if args.temperature == 0 else f"temperature {args.temperature:g}"
    print(f"latency: batch {args.batch_size}, input {args.input_len}, output {args.output_len}, {sampling}; "
          f"startup {g['startup_s']:.1f} s (load {g['load_s']:.1f} s, graphs {g['graph_capture_s']:.1f} s); "
          f"weights {g['weight_bytes'] / 1e9:.2f} GB ({g['read_weight_bytes'] / 1e9:.2f} GB read a step), "
          f"KV/step {g['kv_bytes_per_step'] / 1e6:.1f} MB")
    print_table(rows)
    if "spec_decode" in g:
        sd = g["spec_decode"]
        print(f"speculative decoding: mean acceptance length {sd['mean_acceptance_length']:.2f} over "
              f"{sd['num_drafts']} verify steps; acceptance per position "
              + " ".join(f"{a:.2f}" for a in sd["acceptance_per_pos"]))
    print(format_startup(g["startup_s"], g["startup_phases"]))
    if g["decode_step_ms"] <= 0:
        # TTFT and the full runs are timed apart, so at a few output tokens on a busy host one slow TTFT run
        # can exceed a whole full run: the difference is then noise, not a step time.
        print(f"warning: the full runs ({g['e2e_s'] * 1e3:.2f} ms) took no longer than TTFT "
              f"({g['ttft_ms']:.2f} ms): the decode steps are below this measurement's noise; "
              "raise --output-len or --num-iters")
    pc = g.get("pdl_choice") or {}
    if pc:
        print(f"batch-1 decode graph at startup ({pc.get('batch1_context', 0)} tokens of context): "
              f"{pc['batch1_ms_pdl']:.3f} ms with PDL, {pc['batch1_ms_no_pdl']:.3f} without -> "
              f"{'PDL' if pc['batch1_pdl'] else 'no PDL'}")
    if g.get("gpu_power"):
        print(format_summary(g["gpu_power"]))
    sc = g.get("step_clock") or {}
    if sc:
        print(f"engine steps of the median run: {sc['steps']}, first intervals {sc['first_intervals_ms']} ms, "
              f"steady median {sc['median_ms']:.3f} / p90 {sc['p90_ms']:.3f} / max {sc['max_ms']:.3f} ms, "
              f"excess over the median {sc['steady_excess_ms']:.2f} ms, last {sc['last_interval_ms']:.3f} ms, "
              f"tail {sc['tail_ms']:.2f} ms, GC {sc['gc_ms']} ms"
              + (f"; {g['steady_decode_tok_s']:.1f} tok/s at the steady median"
                 if g.get("steady_decode_tok_s") else ""))
    if "profile" in g:
        pr = g["profile"]
        print(f"CUDA kernels per decode step: {pr['kernels_per_step']:.1f} "
              f"({pr['kernels_per_layer']:.2f} per layer); GPU busy {pr['gpu_busy_us_per_step']:.0f} us of a "
              f"{pr['gpu_span_us_per_step']:.0f} us span per step")
        if g.get("graph_replay_ms"):
            print(f"decode graph replayed back to back: {g['graph_replay_ms']:.3f} ms/step "
                  f"(host-free floor; measured step {g['decode_step_ms']:.3f} ms)")
        at = g.get("graph_replay_ms_at_context") or {}
        if at:
            print("decode graph replay by context (tokens: ms): "
                  + ", ".join(f"{c}: {ms:.3f}" for c, ms in at.items()))
        at = g.get("short_graph_replay_ms_at_context") or {}
        if at:
            print("one-split graph by context (tokens: ms): "
                  + ", ".join(f"{c}: {ms:.3f}" for c, ms in at.items()))
        for name, count, us in pr["top_kernels"]:
            print(f"  {us:8.1f} us {count:6.1f}x  {name}")
        if pr.get("kernels_by_op"):
            print("by op (launches / GPU us a step): " + ", ".join(
                f"{op} {n:.0f} / {us:.0f}" for op, (n, us) in pr["kernels_by_op"].items()))
        if pr.get("idle_by_pair"):
            print(f"device busy (kernels and copies, overlaps once) {pr['gpu_busy_union_us_per_step']:.0f} us a step; "
                  "idle a step between:")
            for us, n, before, after in pr["idle_by_pair"]:
                print(f"  {us:8.2f} us {n:5.2f}x  {before} -> {after}")
        pp = g.get("prefill_profile") or {}
        if pp:
            print(f"prefill of {pp['tokens']} tokens: {pp['kernels']} kernels, GPU busy {pp['gpu_busy_ms']:.2f} ms of "
                  f"a {pp['gpu_span_ms']:.2f} ms span; the layers' GEMMs ({pp['layer_tflop']:.1f} TFLOP) at "
                  f"{pp['layer_tflop_per_s_over_span']:.0f} TFLOP/s over the span")
            for name, count, ms in pp["top_kernels"]:
                print(f"  {ms:8.2f} ms {count:6d}x  {name}")
    if "unfused" in results:
        _print_fused_vs_unfused(g, results["unfused"])
    if g.get("step_events"):
        print(format_step_events(g["step_events"], g.get("step_events_back_to_back_ms") or {}))
    for line in format_timeline(g.get("ttft_timeline") or {}):
        print(line)
    write_json(args, {"bench": "latency", **run_info(args), "results": results})
    return 0


if __name__ == "__main__":  # run_unfused's child: the arguments' JSON in, run_gyrfalcon's results' JSON out
    _ns = argparse.Namespace(**json.loads(Path(sys.argv[1]).read_text()))
    Path(sys.argv[2]).write_text(json.dumps(run_gyrfalcon(_ns), default=str))
