"""What `gyrfalcon bench serve` computes from its requests' results and how it reports them: vLLM's metrics (counts,
throughputs, goodput, mean / median / std / percentiles of TTFT, TPOT, ITL and E2EL in ms), the printed report and
the result file."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

# What --percentile-metrics may name (vLLM's names); the report and the JSON hold the selected ones.
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
# --goodput's SLO keys (milliseconds), as vLLM's.
GOODPUT_KEYS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    server_prompt_tokens: int = 0  # usage.prompt_tokens of the last chunk (0: none came)
    first_chunk_text: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: List[float] = field(default_factory=list)
    token_times: List[float] = field(default_factory=list)  # absolute arrival times of content chunks
    error: str = ""


def _stats(values: List[float], percentiles: List[float]) -> Dict[str, float]:
    a = np.asarray(values, dtype=np.float64) * 1000.0 if values else np.zeros(1)
    out = {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std())}
    for p in percentiles:
        out[f"p{p:g}"] = float(np.percentile(a, p))
    return out


def parse_goodput(items: Optional[List[str]]) -> Dict[str, float]:
    """--goodput ttft:500 tpot:50 -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: Dict[str, float] = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(f"--goodput {item!r}: expected KEY:MILLISECONDS with KEY one of {list(GOODPUT_KEYS)}.")
        try:
            slos[key] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds.") from None
        if slos[key] < 0:
            raise ValueError(f"--goodput {item!r}: an SLO is not negative.")
    return slos


def parse_percentile_metrics(text: str) -> List[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in PERCENTILE_METRICS]
    if bad or not names:
        raise ValueError(f"--percentile-metrics {text!r}: choose from {', '.join(PERCENTILE_METRICS)}.")
    return names


def _tpot(r: RequestResult) -> float:
    return (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0


def summarize(results: List[RequestResult], duration: float, percentiles: List[float],
              metrics: Sequence[str] = PERCENTILE_METRICS, goodput: Optional[Dict[str, float]] = None
              ) -> Dict[str, Any]:
    """vLLM's result keys: counts, throughputs, and mean / median / std / pN of each of `metrics` in ms;
    request_goodput: the requests per second that met every --goodput SLO (None without SLOs)."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    tpots = [_tpot(r) for r in ok if r.output_tokens > 1]
    itls = [x for r in ok for x in r.itl]
    # Peak tokens per second over 1 s windows. A chunk may carry several tokens or (an unfinished
    # character, text held back for a stop string) none: spread each request's tokens over its chunks.
    times = np.asarray([t for r in ok for t in r.token_times])
    weights = np.asarray([r.output_tokens / len(r.token_times) for r in ok for _ in r.token_times])
    peak = 0.0
    if times.size:
        buckets = np.floor(times - times.min()).astype(np.int64)
        peak = float(np.bincount(buckets, weights=weights).max())
    good = None
    if goodput:
        def meets(r: RequestResult) -> bool:
            got = {"ttft": r.ttft * 1000, "tpot": _tpot(r) * 1000, "e2el": r.latency * 1000}
            return all(got[k] <= v for k, v in goodput.items())
        good = sum(1 for r in ok if meets(r)) / duration
    m: Dict[str, Any] = {
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration, "request_goodput": good,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration, "max_output_tokens_per_s": peak}
    values = {"ttft": [r.ttft for r in ok], "tpot": tpots, "itl": itls, "e2el": [r.latency for r in ok]}
    for name in metrics:
        for k, v in _stats(values[name], percentiles).items():
            m[f"{k}_{name}_ms"] = v
    return m


_TITLES = {"ttft": ("Time to First Token", "TTFT"), "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
           "itl": ("Inter-token Latency", "ITL"), "e2el": ("End-to-end Latency", "E2EL")}


def print_report(m: Dict[str, Any], args, percentiles: List[float], metrics: Sequence[str] = PERCENTILE_METRICS
                 ) -> None:
    w = 50
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w, c="="))
    rows = [("Successful requests:", m["completed"]), ("Failed requests:", m["failed"]),
            ("Maximum request concurrency:", args.max_concurrency),
            ("Request rate configured (RPS):", args.request_rate),
            ("Benchmark duration (s):", f"{m['duration']:.2f}"),
            ("Total input tokens:", m["total_input_tokens"]), ("Total generated tokens:", m["total_output_tokens"]),
            ("Request throughput (req/s):", f"{m['request_throughput']:.2f}")]
    if m.get("request_goodput") is not None:
        rows.append(("Request goodput (req/s):", f"{m['request_goodput']:.2f}"))
    rows += [("Output token throughput (tok/s):", f"{m['output_throughput']:.2f}"),
             ("Peak output token throughput (tok/s):", f"{m['max_output_tokens_per_s']:.2f}"),
             ("Total Token throughput (tok/s):", f"{m['total_token_throughput']:.2f}")]
    for k, v in rows:
        print("{:<40} {:<10}".format(k, str(v)))
    if m.get("spec_decode_num_drafts"):
        print("{s:{c}^{n}}".format(s="Speculative Decoding", n=w, c="-"))
        rate = m["spec_decode_acceptance_rate"]
        for k, v in (("Acceptance rate (%):", "n/a" if rate is None else f"{rate:.2f}"),
                     ("Acceptance length:", f"{m['spec_decode_acceptance_length']:.2f}"),
                     ("Drafts:", m["spec_decode_num_drafts"]), ("Draft tokens:", m["spec_decode_draft_tokens"]),
                     ("Accepted tokens:", m["spec_decode_accepted_tokens"])):
            print("{:<40} {:<10}".format(k, str(v)))
    for name in metrics:
        title, label = _TITLES[name]
        print("{s:{c}^{n}}".format(s=title, n=w, c="-"))
        print("{:<40} {:<10.2f}".format(f"Mean {label} (ms):", m[f"mean_{name}_ms"]))
        print("{:<40} {:<10.2f}".format(f"Median {label} (ms):", m[f"median_{name}_ms"]))
        for p in percentiles:
            print("{:<40} {:<10.2f}".format(f"P{p:g} {label} (ms):", m[f"p{p:g}_{name}_ms"]))
    print("=" * w)


def result_path(args, model: str) -> Optional[str]:
    """--save-result's file: --result-dir / --result-filename, by default named as vLLM names it
    (<backend>-<rate>qps[-concurrency<N>]-<model>-<date>.json; --profile aa: <backend>-aa-<model>-<date>.json); a
    path given to --save-result itself wins."""
    if args.save_result is None:
        return None
    if isinstance(args.save_result, str) and args.save_result:
        return args.save_result
    name = args.result_filename
    if not name:
        conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
        run = "aa" if getattr(args, "profile", None) == "aa" else f"{args.request_rate}qps{conc}"
        date = datetime.now().strftime("%Y%m%d-%H%M%S")
        name = f"{args.label or args.backend}-{run}-{model.split('/')[-1]}-{date}.json"
    return os.path.join(args.result_dir or ".", name)


def write_result(path: str, out: Dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
    print(f"Saved the results to {path}")


def parse_metadata(items: Optional[List[str]]) -> Dict[str, str]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--metadata {item!r}: expected KEY=VALUE.")
        out[key] = value
    return out


# The speculative-decoding counters a server exposes at /metrics (gyrfalcon's or vLLM's prefix), by their name
# after the prefix.
_SPEC_COUNTERS = {"spec_decode_num_drafts_total": "drafts", "spec_decode_num_draft_tokens_total": "draft_tokens",
                  "spec_decode_num_accepted_tokens_total": "accepted_tokens"}
_SPEC_PER_POS = "spec_decode_num_accepted_tokens_per_pos_total"


def spec_decode_counts(metrics_text: str) -> Dict[str, Any]:
    """The speculative-decoding counters of a /metrics page: {"drafts", "draft_tokens", "accepted_tokens",
    "per_pos": {position: accepted}}, summed over models; {} when the server counts none."""
    from prometheus_client.parser import text_string_to_metric_families

    out: Dict[str, Any] = {}
    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:
            name = s.name.split(":", 1)[-1]
            if name in _SPEC_COUNTERS:
                key = _SPEC_COUNTERS[name]
                out[key] = out.get(key, 0.0) + s.value
            elif name == _SPEC_PER_POS and "position" in s.labels:
                pos = out.setdefault("per_pos", {})
                pos[int(s.labels["position"])] = pos.get(int(s.labels["position"]), 0.0) + s.value
    return out


def spec_decode_summary(before: Dict[str, Any], after: Dict[str, Any]) -> Dict[str, Any]:
    """The run's acceptance from two /metrics readings (../SPEC_DECODE.md: acceptance length = 1 + accepted /
    drafts), under vLLM's bench serve keys; {} when no draft was made in between."""
    drafts = after.get("drafts", 0.0) - before.get("drafts", 0.0)
    if drafts <= 0:
        return {}
    draft_tokens = after.get("draft_tokens", 0.0) - before.get("draft_tokens", 0.0)
    accepted = after.get("accepted_tokens", 0.0) - before.get("accepted_tokens", 0.0)
    per_pos = after.get("per_pos", {})
    return {"spec_decode_num_drafts": int(drafts), "spec_decode_draft_tokens": int(draft_tokens),
            "spec_decode_accepted_tokens": int(accepted),
            "spec_decode_acceptance_length": 1.0 + accepted / drafts,
            "spec_decode_acceptance_rate": 100.0 * accepted / draft_tokens if draft_tokens else None,
            "spec_decode_per_position_acceptance_rates": [
                (per_pos[p] - before.get("per_pos", {}).get(p, 0.0)) / drafts for p in sorted(per_pos)]}
