"""Shared pieces of the offline benchmarks: prompts, run metadata, JSON output, tables."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

from gyrfalcon import envs

# H200 HBM read bandwidth measured on the benchmark machine (GPU.md): a reduction over 1 GiB.
HBM_BYTES_PER_S = 4.15e12
# H200 (SXM) dense bf16 tensor-core peak from NVIDIA's datasheet (989.4 TFLOP/s; fp8 doubles it).
BF16_FLOP_PER_S = 989e12
# What a bf16 matmul reaches on the benchmark machine (GPU.md: 8192^3, ~789 TFLOP/s at full clocks).
MATMUL_FLOP_PER_S = 789e12


def _nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def moe_blocks(model) -> list:
    """[(expert bytes, expert parameters, num_experts, top_k)] per MoE layer of a gyrfalcon model: the routed
    experts (layers/moe.py SparseMoE.experts, FP8 scales included) of each block whose router picks top_k."""
    out = []
    for m in model.modules():
        gate, experts = getattr(m, "gate", None), getattr(m, "experts", None)
        if experts is not None and hasattr(gate, "top_k") and hasattr(experts, "num_experts"):
            params = list(experts.parameters())
            out.append((_nbytes(params), sum(p.numel() for p in params), experts.num_experts, gate.top_k))
    return out


def experts_touched(num_experts: int, top_k: int, rows: int) -> float:
    """The experts a step of `rows` tokens reads in one MoE layer: exactly top_k at one row (a token's experts are
    distinct); for more rows, the expectation when each row picks top_k of num_experts uniformly at random,
    E * (1 - (1 - k / E)^rows) (random-weight benchmarks route close to that; a real model's skew reads fewer)."""
    if rows <= 1:
        return float(min(top_k, num_experts)) if rows == 1 else 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** rows)


def step_weight_bytes(model, rows: int = 1) -> int:
    """The weight bytes a decode step of `rows` tokens reads: the layers, the final norm and the LM head (an
    untied embedding table is only gathered from, a row a token); of an MoE layer's routed experts only those the
    step's tokens select (experts_touched)."""
    total = (_nbytes(model.model.layers.parameters()) + _nbytes([model.lm_head.weight])
             + _nbytes(model.model.norm.parameters()))
    for nbytes, _, E, k in moe_blocks(model):
        total -= nbytes - int(nbytes * experts_touched(E, k, rows) / E)
    return total


class StepFloor:
    """The least time a run's scheduled steps could take on this GPU: per step, the larger of (bytes it must
    read / HBM bandwidth) and (FLOPs / the dense bf16 peak), summed. Bytes: the weights a step reads (the
    layers and the LM head: an untied embedding table is only gathered from; of an MoE layer's routed experts,
    those the step's tokens select, experts_touched) plus the K/V of every scheduled sequence's context after
    the step. FLOPs: 2 x the layers' parameters a token runs (top_k of E experts) per token, plus
    attention's 4 x layers x heads x head_dim per (token, context position), causal for prompt chunks.
    A run's time over this floor is its fraction of the roofline (the throughput row's counterpart of
    bench latency's per-step figure).

    That floor overlaps a step's GEMM arithmetic with its attention's K/V reads, which kernels run one after
    the other cannot do. The serial floor (serial_s) times each step as its kernels run: the GEMMs at the
    larger of (their FLOPs, the LM head's included, at MATMUL_FLOP_PER_S: what a bf16 matmul reaches on this
    machine) and (the weight bytes / HBM bandwidth), then attention at the larger of (its K/V bytes / HBM
    bandwidth) and (its FLOPs at MATMUL_FLOP_PER_S)."""

    def __init__(self, step_weight_bytes: int, kv_bytes_per_token: int, layer_params: int,
                 attn_flops_per_pair: int, head_params: int = 0, moe: Optional[list] = None) -> None:
        # moe: bench.common.moe_blocks' [(expert bytes, ...)]; step_weight_bytes then counts the weights without
        # those experts, and layer_params the parameters a token runs (each layer's top_k experts of E).
        self.step_weight_bytes = step_weight_bytes
        self.moe = list(moe or ())
        self.kv_bytes_per_token = kv_bytes_per_token
        self.layer_params = layer_params
        self.attn_flops_per_pair = attn_flops_per_pair
        self.head_params = head_params
        self.steps = 0
        self.bytes = 0
        self.flops = 0
        self.floor_s = 0.0
        self.serial_s = 0.0
        # Per step, in schedule order: (kind, rows, floor seconds); kind "decode" (every row one token) or
        # "prefill" (some row runs a prompt chunk). StepFloor.by_kind splits a run's wall time with it.
        self.step_log: list = []

    @classmethod
    def for_model(cls, model, kv_bytes_per_token: int) -> "StepFloor":
        """From a Llama-family model of gyrfalcon's (model.model.layers, embed_tokens, lm_head)."""
        layers = list(model.model.layers.parameters())
        attn = model.model.layers[0].self_attn
        moe = moe_blocks(model)
        dense_bytes = step_weight_bytes(model, rows=0)  # every weight but the routed experts'
        active = sum(p.numel() for p in layers) - sum(n - n * k / E for _, n, E, k in moe)
        return cls(dense_bytes, kv_bytes_per_token, int(active),
                   4 * len(model.model.layers) * attn.num_heads * attn.head_dim, model.lm_head.weight.numel(), moe)

    def add(self, batch) -> None:
        """One ScheduledBatch (scheduler.schedule's result)."""
        if batch.is_empty:
            return
        kv = flops = attn_flops = head_rows = 0
        for sr in batch.reqs:
            n, ctx = sr.num_new_tokens, sr.start + sr.num_new_tokens
            kv += ctx * self.kv_bytes_per_token
            # Token i of the chunk (0-based) attends to start + i + 1 positions.
            pairs = n * sr.start + n * (n + 1) // 2
            flops += 2 * self.layer_params * n + self.attn_flops_per_pair * pairs
            attn_flops += self.attn_flops_per_pair * pairs
            # A prompt chunk that leaves part of its prompt samples nothing: no LM-head row (sample unset: one).
            head_rows += 1 if getattr(sr, "sample", True) else 0
        rows = sum(sr.num_new_tokens for sr in batch.reqs)
        wbytes = self.step_weight_bytes + int(sum(b * experts_touched(E, k, rows) / E for b, _, E, k in self.moe))
        step_bytes = wbytes + kv
        step_floor = max(step_bytes / HBM_BYTES_PER_S, flops / BF16_FLOP_PER_S)
        gemm_flops = flops - attn_flops + 2 * self.head_params * head_rows
        self.serial_s += (max(gemm_flops / MATMUL_FLOP_PER_S, wbytes / HBM_BYTES_PER_S)
                          + max(kv / HBM_BYTES_PER_S, attn_flops / MATMUL_FLOP_PER_S))
        self.steps += 1
        self.bytes += step_bytes
        self.flops += flops
        self.floor_s += step_floor
        kind = "decode" if all(sr.num_new_tokens == 1 for sr in batch.reqs) else "prefill"
        self.step_log.append((kind, len(batch.reqs), step_floor))

    def by_kind(self, start: float, done: list, host: Optional[dict] = None) -> dict:
        """Wall time and floor per kind of step. done: the host time at which each step's tokens were read
        back, in launch order (the engine completes steps in order); start: when the run began. The
        interval that ends at a step's read-back is charged to it: under async scheduling the next step is
        already queued, so the intervals are the device's step times, as long as the host keeps up.
        host: {phase: [seconds per step, in schedule order]} (schedule, launch, complete), reported as the
        mean ms per step of each kind: a launch that takes as long as the device's step waited on it."""
        out: dict = {}
        prev = start
        for i, ((kind, rows, fl), t) in enumerate(zip(self.step_log, done)):
            d = out.setdefault(kind, {"steps": 0, "rows": 0, "wall_s": 0.0, "floor_s": 0.0})
            d["steps"] += 1
            d["rows"] += rows
            d["wall_s"] += t - prev
            d["floor_s"] += fl
            for phase, times in (host or {}).items():
                if i < len(times):
                    d.setdefault("host_s", {}).setdefault(phase, 0.0)
                    d["host_s"][phase] += times[i]
            prev = t
        for d in out.values():
            d["mean_rows"] = d["rows"] / d["steps"]
            d["roofline_fraction"] = d["floor_s"] / d["wall_s"] if d["wall_s"] > 0 else 0.0
            d["ms_per_step"] = d["wall_s"] / d["steps"] * 1e3
            if "host_s" in d:
                d["host_ms_per_step"] = {k: v / d["steps"] * 1e3 for k, v in d.pop("host_s").items()}
        return out

    def report(self, elapsed_s: float) -> dict:
        return {"steps": self.steps, "bytes_read_gb": self.bytes / 1e9, "tflop": self.flops / 1e12,
                "floor_s": self.floor_s, "roofline_fraction": self.floor_s / elapsed_s if elapsed_s > 0 else 0.0,
                "serial_floor_s": self.serial_s,
                "serial_floor_fraction": self.serial_s / elapsed_s if elapsed_s > 0 else 0.0}


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output-json", default=None, help="write the results here")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy (default); vLLM's bench latency / throughput sample at 1.0 (top-p 1.0)")
    p.add_argument("--baseline", choices=["hf"], default=None,
                   help="also run Hugging Face transformers on the same checkpoint and print ratios")


def hf_sampling_kwargs(temperature: float) -> dict:
    """transformers generate's arguments for the benchmark's --temperature: greedy at 0, else sampling
    at that temperature with top-k and top-p off (as gyrfalcon's and vLLM's benchmarks draw)."""
    if temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}


def random_prompts(n: int, length: int, vocab: int, seed: int) -> List[List[int]]:
    import random

    rng = random.Random(seed)
    # Distinct first tokens keep prompts from sharing cached prefixes by accident.
    return [[(i * 7919 + 13) % vocab] + [rng.randrange(vocab) for _ in range(length - 1)] for i in range(n)]


def run_info(args: argparse.Namespace) -> dict:
    """GPU, commit, command, date and switches (gyrfalcon/envs.py's values) of a benchmark run. The commit is
    GYRFALCON_COMMIT when set (a copy of the tree on another machine may carry a stale .git), else git's HEAD,
    marked -dirty when the tree differs from it."""
    env = envs.get()
    commit = env.commit
    if not commit:
        try:
            here = Path(__file__).parent
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=here, timeout=10).stdout.strip()
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, cwd=here, timeout=10).stdout.strip()
            if commit and dirty:
                commit += "-dirty"
        except Exception:
            commit = ""
    gpu = ""
    try:
        import torch
        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name()
    except Exception:
        pass
    # The envs.py switches the run was under (an A/B's two halves differ only there); not the API key
    switches = {k: v for k, v in dataclasses.asdict(env).items() if k not in ("commit", "api_key")}
    return {"gpu": gpu or "cpu", "commit": commit, "command": " ".join(["gyrfalcon"] + sys.argv[1:]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "args": {k: v for k, v in vars(args).items() if k != "func"}, "switches": switches}


def write_json(args: argparse.Namespace, payload: dict) -> None:
    if args.output_json:
        path = Path(args.output_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=2, default=str))
        print(f"wrote {path}")


def print_table(rows: List[List[str]]) -> None:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(str(c).rjust(w) for c, w in zip(r, widths)))


def startup_phases(llm, startup_s: float) -> dict:
    """Seconds of each startup phase of `llm` (the runner's: device_init, load, draft_load (EAGLE-3), kv_sizing,
    kv_alloc, decode_graphs, prefill_graphs), and "other": the rest of startup_s (config, tokenizer, engine
    set-up)."""
    phases = dict(llm.engine.runner.startup_phases)
    phases["other"] = max(0.0, startup_s - sum(phases.values()))
    return phases


def format_startup(startup_s: float, phases: dict) -> str:
    return f"startup {startup_s:.1f} s: " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items())


@contextlib.contextmanager
def scoped_env(values: dict):
    """os.environ with `values` set inside the block (a value of None: the variable unset), as it was after: the
    benchmarks' same-process A/Bs of switches that the kernels read at launch. envs.get() reads them again
    on each side of the block."""
    def apply(vals: dict) -> None:
        for k, v in vals.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        envs.refresh()

    old = {k: os.environ.get(k) for k in values}
    try:
        apply(values)
        yield
    finally:
        apply(old)


class GCPauses:
    """The cyclic garbage collector's pauses while entered (a context manager): each one's generation and
    seconds go to on_pause(generation, seconds), called as the pause ends (gc.callbacks)."""

    def __init__(self, on_pause) -> None:
        self.on_pause = on_pause
        self._start: Optional[float] = None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.on_pause(info.get("generation", 2), time.perf_counter() - self._start)
            self._start = None

    def __enter__(self):
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)


def busy_span_gaps(events: list) -> tuple:
    """events: [(start us, end us, name)] sorted by start, possibly overlapping (concurrent streams) ->
    (busy ms: the union of the intervals, span ms: first start to last end, gaps: [(idle ms, name of the
    kernel that ended the busy stretch, name of the one that began the next)], longest first)."""
    busy, gaps = 0.0, []
    end, prev_name = None, None  # the end of the busy stretch so far, and the kernel that ends it
    for start, stop, name in events:
        if end is not None and start > end:
            gaps.append(((start - end) / 1e3, prev_name, name))
        if end is None or start > end:
            busy += (stop - start) / 1e3
        elif stop > end:
            busy += (stop - end) / 1e3
        if end is None or stop > end:
            end, prev_name = stop, name
    span = (end - events[0][0]) / 1e3 if events else 0.0
    gaps.sort(key=lambda g: -g[0])
    return busy, span, gaps


def gaps_by_pair(gaps: list, steps: int, top: int = 8) -> list:
    """gaps from busy_span_gaps -> [[idle us a step, gaps a step, kernel before, kernel after]] summed over each
    (before, after) pair of names, most idle first: where in a step the device waits, not only the longest waits."""
    pairs: dict = {}
    for ms, before, after in gaps:
        key = ((before or "")[:60], (after or "")[:60])
        tot = pairs.setdefault(key, [0.0, 0])
        tot[0] += ms * 1e3
        tot[1] += 1
    rows = sorted(pairs.items(), key=lambda kv: -kv[1][0])[:top]
    return [[round(us / steps, 2), round(n / steps, 2), b, a] for (b, a), (us, n) in rows]
