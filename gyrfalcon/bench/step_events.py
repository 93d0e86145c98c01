"""The device time of each decode step inside the engine, from CUDA events around the decode graph's replay.

`bench latency` reports a steady step interval (StepClock: the host's time between engine steps), and --profile
the decode graph replayed back to back (replay_at_contexts). StepEvents records an event before and after each
replay call (the inputs' host-to-device copies, made inside the call, are in the replay's time) and splits the
step into each replay's device time and the device time between one replay's end and the next one's start
(the LM head and argmax, which run after the graph).

It also says whether the host was late: the share of replays launched after the previous one had already ended
on the device (its end event complete when the next launch began: the device then waited on the host), and the
host's milliseconds inside each replay call and inside each step's completion (the wait for a step's tokens:
near zero when the host, not the device, is behind).
"""

from __future__ import annotations

from typing import List


def _quantiles(xs: List[float]) -> dict:
    s = sorted(xs)
    return {"median": s[len(s) // 2], "p90": s[int(0.9 * (len(s) - 1))], "max": s[-1], "sum": sum(s)}


def summarize_step_events(replay_ms: List[float], gap_ms: List[float], late: List[bool] = (),
                          run_host_ms: List[float] = (), complete_host_ms: List[float] = ()) -> dict:
    """replay_ms: each replay's device time; gap_ms: the device time from each replay's end to the next one's
    start (one fewer); late: per replay after the first, whether the previous replay had ended when it was
    launched; run_host_ms / complete_host_ms: the host's time in each replay call / each step completion ->
    {replays, replay_ms: {median, p90, max, sum}, gap_ms, late_fraction, run_host_ms, complete_host_ms}
    (each part only with data; {} without replays)."""
    if not replay_ms:
        return {}
    out = {"replays": len(replay_ms), "replay_ms": _quantiles(replay_ms)}
    if gap_ms:
        out["gap_ms"] = _quantiles(gap_ms)
    if late:
        out["late_fraction"] = sum(late) / len(late)
    if run_host_ms:
        out["run_host_ms"] = _quantiles(list(run_host_ms))
    if complete_host_ms:
        out["complete_host_ms"] = _quantiles(list(complete_host_ms))
    return out


class StepEvents:
    """with-style watcher: events = StepEvents(runner); events.watch(fn) runs fn() with every decode-graph
    replay bracketed by CUDA events; summary(i) for the i-th watched run. Records nothing without a graph
    runner or off CUDA (the CPU runs the step eagerly)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.graph_runner = getattr(runner, "graph_runner", None)
        self.enabled = self.graph_runner is not None and runner.device.type == "cuda"
        self.runs: list = []

    def watch(self, fn):
        if not self.enabled:
            self.runs.append([])
            return fn()
        import time

        import torch

        pairs: list = []
        late: list = []
        run_host: list = []
        complete_host: list = []
        self.runs.append((pairs, late, run_host, complete_host))
        gr, runner = self.graph_runner, self.runner
        inner, inner_complete = gr.run, runner.complete

        def run(*args, **kwargs):
            t = time.perf_counter()
            if pairs:
                late.append(pairs[-1][1].query())  # the previous replay already over: the device waited
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = inner(*args, **kwargs)
            end.record()
            pairs.append((start, end))
            run_host.append((time.perf_counter() - t) * 1e3)
            return out

        def complete(handle):
            t = time.perf_counter()
            out = inner_complete(handle)
            complete_host.append((time.perf_counter() - t) * 1e3)
            return out

        gr.run, runner.complete = run, complete
        try:
            return fn()
        finally:
            del gr.run, runner.complete  # back to the classes' methods
            torch.cuda.synchronize()

    def summary(self, run: int) -> dict:
        if run >= len(self.runs) or not self.runs[run]:
            return {}
        pairs, late, run_host, complete_host = self.runs[run]
        replay = [s.elapsed_time(e) for s, e in pairs]
        gaps = [pairs[i - 1][1].elapsed_time(pairs[i][0]) for i in range(1, len(pairs))]
        return summarize_step_events(replay, gaps, late, run_host, complete_host)


def format_step_events(s: dict, back_to_back: dict) -> str:
    """One line: the replays' device time in the engine against the graph replayed back to back."""
    if not s:
        return ""
    r = s["replay_ms"]
    line = (f"decode steps on the device (CUDA events, {s['replays']} replays): replay median {r['median']:.3f} / "
            f"p90 {r['p90']:.3f} ms")
    if "gap_ms" in s:
        g = s["gap_ms"]
        line += f", between replays median {g['median']:.3f} / p90 {g['p90']:.3f} ms (sum {g['sum']:.2f})"
    if "late_fraction" in s:
        line += f"; {s['late_fraction']:.0%} launched after the previous replay had ended"
    for key, what in (("run_host_ms", "host in the replay call"), ("complete_host_ms", "host completing a step")):
        if key in s:
            line += f"; {what} median {s[key]['median']:.3f} ms"
    if back_to_back:
        line += "; back to back at " + ", ".join(f"{k}: {v:.3f}" for k, v in back_to_back.items()) + " ms"
    return line
