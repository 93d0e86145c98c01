"""Where a TTFT goes on the host: one generate of max_tokens=1 (what `bench latency` times as TTFT) under
torch.profiler with CPU and CUDA activity, reported as offsets from the generate's start.

The prefill's kernels keep the GPU busy for most of a long batch's TTFT, but the TTFT also holds the host
work before the first kernel (admission, scheduling, input preparation) and after the last (sampling's
readback, the finished requests' outputs). `bench latency --profile` compares the two only in total
(TTFT against the prefill's GPU span); this says which side the difference is on and which host calls
fill it: CUDA runtime calls that block (a synchronize, a cudaMalloc) are listed on their own.

The profiler's CPU activity records every aten op, which slows the host a little (a few microseconds an
op): the offsets are upper bounds on the unprofiled ones.
"""

from __future__ import annotations

from typing import Iterable, List, Tuple

from gyrfalcon.bench.common import busy_span_gaps

# Host ranges the timeline marks (torch.profiler.record_function names).
GENERATE, ADD_REQUEST, STEP = "gf.generate", "gf.add_request", "gf.step"
# A CUDA runtime call longer than this is listed (a launch takes ~5-25 us; a blocking call far longer).
SLOW_RUNTIME_US = 200.0

Event = Tuple[str, float, float]  # (name, start us, end us)


def summarize_timeline(ranges: Iterable[Event], device: Iterable[Event],
                       host_ops: Iterable[Tuple[str, float, float, float]], top: int = 10) -> dict:
    """ranges: the gf.* record_function ranges; device: every CUDA activity (kernels, copies, memsets);
    host_ops: (name, start us, end us, self us) of the other CPU events (aten ops, CUDA runtime calls).
    Times in ms from the generate's start ({} without a gf.generate range):
      generate_ms, admission_ms (the add_request calls) and admission_end_ms,
      steps: [[start, duration]] of each engine.step call,
      first_device_ms / last_device_end_ms (and the first activity's name), after_device_ms (the generate's
      end less the last device activity's), device_busy_ms (union) and device_idle_ms inside the device span,
      device_gaps: the longest idle gaps inside it [[ms, before, after]],
      host_before_device: the host ops with the most self time before the first device activity [[name, ms]],
      slow_runtime_calls: CUDA runtime calls over SLOW_RUNTIME_US [[name, start, duration]], longest first."""
    ranges = list(ranges)
    gen = [r for r in ranges if r[0] == GENERATE]
    if not gen:
        return {}
    t0, t_end = gen[0][1], gen[0][2]
    ms = lambda us: round((us - t0) / 1e3, 3)  # noqa: E731  an offset from the generate's start
    adds = [r for r in ranges if r[0] == ADD_REQUEST]
    steps = [r for r in ranges if r[0] == STEP]
    out = {
        "generate_ms": round((t_end - t0) / 1e3, 3),
        "admission_ms": round(sum(e - s for _, s, e in adds) / 1e3, 3),
        "admission_end_ms": ms(max(e for _, _, e in adds)) if adds else None,
        "steps": [[ms(s), round((e - s) / 1e3, 3)] for _, s, e in sorted(steps, key=lambda r: r[1])],
    }
    dev = sorted((s, e, n) for n, s, e in device)
    host_ops = list(host_ops)
    first = dev[0][0] if dev else t_end
    if dev:
        busy, span, gaps = busy_span_gaps(dev)
        last = max(e for _, e, _ in dev)
        out.update({
            "first_device_ms": ms(first), "first_device_name": dev[0][2][:80],
            "last_device_end_ms": ms(last), "after_device_ms": round((t_end - last) / 1e3, 3),
            "device_busy_ms": round(busy, 3), "device_idle_ms": round(span - busy, 3),
            "device_gaps": [[round(g, 3), (b or "")[:60], (a or "")[:60]] for g, b, a in gaps[:top]],
        })
    before: dict = {}
    for name, s, e, self_us in host_ops:
        if t0 <= s < first:
            before[name] = before.get(name, 0.0) + self_us
    out["host_before_device"] = [[n[:80], round(us / 1e3, 3)]
                                 for n, us in sorted(before.items(), key=lambda kv: -kv[1])[:top]]
    slow = [(n, s, e) for n, s, e, _ in host_ops if n.startswith("cuda") and e - s > SLOW_RUNTIME_US]
    out["slow_runtime_calls"] = [[n[:60], ms(s), round((e - s) / 1e3, 3)]
                                 for n, s, e in sorted(slow, key=lambda x: x[2] - x[1], reverse=True)[:top]]
    return out


def ttft_timeline(llm, prompts: List[List[int]], temperature: float = 0.0) -> dict:
    """Profile one generate of `prompts` at max_tokens=1 (prefix cache reset before and after, as the TTFT
    row runs it) and summarize it (summarize_timeline). On a CPU the profile holds host events only."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from gyrfalcon.sampling_params import SamplingParams

    engine = llm.engine
    engine.block_manager.reset_prefix_cache()
    sp = SamplingParams(temperature=temperature, max_tokens=1, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    cuda = torch.cuda.is_available() and engine.runner.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    inner_step, inner_add = engine.step, engine.add_request

    def step():
        with record_function(STEP):
            return inner_step()

    def add_request(*args, **kwargs):
        with record_function(ADD_REQUEST):
            return inner_add(*args, **kwargs)

    engine.step, engine.add_request = step, add_request
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        with profile(activities=acts) as prof:
            with record_function(GENERATE):
                llm.generate(inputs, sp, use_tqdm=False)
            if cuda:
                torch.cuda.synchronize()
    finally:
        del engine.step, engine.add_request  # back to the class's methods
        engine.block_manager.reset_prefix_cache()
    return summarize_events(prof.events())


def summarize_events(events) -> dict:
    """torch.profiler FunctionEvents -> summarize_timeline's dict."""
    import torch

    cuda_type = torch.autograd.DeviceType.CUDA
    ranges, device, host = [], [], []
    for e in events:
        item = (e.name, e.time_range.start, e.time_range.end)
        if e.device_type == cuda_type:
            device.append(item)
        elif e.name in (GENERATE, ADD_REQUEST, STEP):
            ranges.append(item)
        else:
            host.append((*item, float(getattr(e, "self_cpu_time_total", 0.0) or 0.0)))
    return summarize_timeline(ranges, device, host)


def format_timeline(t: dict) -> List[str]:
    """Printable lines for a summarize_timeline dict."""
    if not t:
        return []
    lines = [f"TTFT timeline (ms from the generate's start, profiled): generate {t['generate_ms']:.2f}, admission "
             f"{t['admission_ms']:.2f} (ends at {t['admission_end_ms']}), engine steps "
             + ", ".join(f"{s:.2f}+{d:.2f}" for s, d in t["steps"])]
    if "first_device_ms" in t:
        lines.append(f"  device: first activity at {t['first_device_ms']:.2f} ({t['first_device_name']}), last ends at "
                     f"{t['last_device_end_ms']:.2f}, then {t['after_device_ms']:.2f} to the end; busy "
                     f"{t['device_busy_ms']:.2f}, idle {t['device_idle_ms']:.2f} inside its span")
        lines += [f"    idle {g:.3f} ms: {b} -> {a}" for g, b, a in t["device_gaps"][:5]]
    if t["host_before_device"]:
        lines.append("  host self time before the first device activity: "
                     + ", ".join(f"{n} {v:.2f}" for n, v in t["host_before_device"][:6]))
    lines += [f"  slow runtime call {n} at {s:.2f}: {d:.2f} ms" for n, s, d in t["slow_runtime_calls"]]
    return lines
