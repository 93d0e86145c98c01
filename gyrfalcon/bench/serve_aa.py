"""`gyrfalcon bench serve --profile aa`: Artificial Analysis's serving workloads against a running server.

AA measures an endpoint with a few fixed workloads (input / output tokens: 100 / 300, 1k / 1k, 10k / 1.5k), one
request at a time and 10 in parallel, each request a fresh prompt (so no prefix-cache hit helps), and reports per
workload and concurrency:
  output speed = tokens received after the first chunk / time after the first chunk   (per request, tokens/s)
  TTFT         = time to the first chunk with content                                   (per request)
as P50 and P90 over the requests. Token counts are the server's (usage in the last streamed chunk); the first
chunk's tokens are its text re-tokenized (a chunk is one step's text, usually one token).

Each run sends --aa-requests-per-stream x concurrency requests of random token ids, ignore_eos so that every answer
has the workload's output length; --aa-scale shrinks every length (a quick check on a small machine or in CI).
"""

from __future__ import annotations

import random
import sys
from datetime import datetime
from typing import Any, Dict, List, Set, Tuple

import numpy as np

from gyrfalcon.bench.serve_client import Target, new_session, run_requests
from gyrfalcon.bench.serve_report import RequestResult, result_path, summarize, write_result
from gyrfalcon.bench.serve_datasets import unique_requests

AA_PERCENTILES = (50.0, 90.0)


def parse_workloads(text: str, scale: float) -> List[Tuple[int, int]]:
    """"100:300,1000:1000" -> [(100, 300), (1000, 1000)], each length times scale (at least 1)."""
    out = []
    for item in text.split(","):
        if not item.strip():
            continue
        a, sep, b = item.partition(":")
        try:
            n_in, n_out = int(a), int(b)
        except ValueError:
            raise ValueError(f"--aa-workloads {item!r}: expected INPUT:OUTPUT token counts.") from None
        if not sep or n_in < 1 or n_out < 1:
            raise ValueError(f"--aa-workloads {item!r}: expected INPUT:OUTPUT token counts.")
        out.append((max(1, round(n_in * scale)), max(1, round(n_out * scale))))
    if not out:
        raise ValueError("--aa-workloads names no workload.")
    return out


def parse_profile_args(args) -> Tuple[List[Tuple[int, int]], List[int]]:
    """(workloads, concurrencies) of the --aa-* flags; ValueError naming the flag that is wrong."""
    workloads = parse_workloads(args.aa_workloads, args.aa_scale)
    try:
        concurrencies = [int(c) for c in args.aa_concurrency.split(",") if c.strip()]
    except ValueError:
        concurrencies = []
    if not concurrencies or min(concurrencies) < 1:
        raise ValueError(f"--aa-concurrency {args.aa_concurrency!r}: expected positive integers, comma-separated.")
    if args.aa_requests_per_stream < 1 or args.aa_scale <= 0:
        raise ValueError("--aa-requests-per-stream and --aa-scale must be positive.")
    return workloads, concurrencies


def output_speed(r: RequestResult, tokenizer) -> float:
    """Tokens after the first chunk / seconds after the first chunk; nan for an answer in one chunk."""
    first = max(1, len(tokenizer.encode(r.first_chunk_text, add_special_tokens=False)))
    after = r.output_tokens - min(first, r.output_tokens)
    span = r.latency - r.ttft
    return after / span if after > 0 and span > 0 else float("nan")


def _pct(values: List[float], p: float) -> float:
    a = np.asarray([v for v in values if v == v], dtype=np.float64)
    return float(np.percentile(a, p)) if a.size else float("nan")


def summarize_run(results: List[RequestResult], duration: float, tokenizer) -> Dict[str, Any]:
    ok = [r for r in results if r.success]
    m = summarize(results, duration, list(AA_PERCENTILES))
    speeds = [output_speed(r, tokenizer) for r in ok]
    ttfts = [r.ttft * 1000 for r in ok]
    m["total_input_tokens"] = sum(r.server_prompt_tokens or r.prompt_len for r in ok)
    for p in AA_PERCENTILES:
        m[f"p{p:g}_output_speed_tok_s"] = _pct(speeds, p)
        m[f"p{p:g}_ttft_ms"] = _pct(ttfts, p)
    m["output_speeds"] = [_finite(v) for v in speeds]
    return {k: _finite(v) if isinstance(v, float) else v for k, v in m.items()}


def _finite(v: float):
    """JSON has no NaN: an undefined value (an answer in one chunk has no output speed) is null."""
    return v if v == v else None


def print_table(runs: List[Dict[str, Any]]) -> None:
    w = 86
    print("{s:{c}^{n}}".format(s=" Artificial Analysis profile ", n=w, c="="))
    print("{:>7} {:>7} {:>5} {:>5} {:>6} | {:>12} {:>12} | {:>11} {:>11}".format(
        "in", "out", "conc", "ok", "failed", "P50 speed", "P90 speed", "P50 TTFT", "P90 TTFT"))
    print("{:>33} | {:>12} {:>12} | {:>11} {:>11}".format("", "(tok/s)", "(tok/s)", "(ms)", "(ms)"))
    for r in runs:
        print("{:>7} {:>7} {:>5} {:>5} {:>6} | {:>12.2f} {:>12.2f} | {:>11.2f} {:>11.2f}".format(
            r["input_len"], r["output_len"], r["max_concurrency"], r["completed"], r["failed"],
            *(float("nan") if r[k] is None else r[k] for k in ("p50_output_speed_tok_s", "p90_output_speed_tok_s",
                                                                "p50_ttft_ms", "p90_ttft_ms"))))
    print("=" * w)


async def run_aa_profile(args, target: Target, tokenizer, tok_path: str, metadata: Dict[str, str]) -> int:
    workloads, concurrencies = parse_profile_args(args)
    target.ignore_eos = True  # every answer the workload's length
    rng = random.Random(args.seed)
    seen: Set[tuple] = set()
    runs: List[Dict[str, Any]] = []
    failed = 0
    async with new_session() as session:
        warm = unique_requests(tokenizer, 1, workloads[0][0], min(workloads[0][1], 4), rng, target.chat, seen)[0]
        test = await target.send(session, warm)
        if not test.success:
            print(f"error: the test request to {target.url} failed: {test.error}", file=sys.stderr, flush=True)
            return 1
        for n_in, n_out in workloads:
            for conc in concurrencies:
                reqs = unique_requests(tokenizer, conc * args.aa_requests_per_stream, n_in, n_out, rng, target.chat,
                                       seen)
                print(f"AA workload {n_in} in / {n_out} out at concurrency {conc}: {len(reqs)} requests...",
                      flush=True)
                results, duration = await run_requests(session, target, reqs, conc)
                m = summarize_run(results, duration, tokenizer)
                failed += m["failed"]
                runs.append({"input_len": n_in, "output_len": n_out, "max_concurrency": conc,
                             "num_prompts": len(reqs), **m})
    print_table(runs)
    path = result_path(args, target.model)
    if path:
        write_result(path, {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "profile": "aa",
                            "backend": args.backend, "endpoint": target.url, "label": args.label,
                            "model_id": target.model, "tokenizer_id": tok_path, "aa_scale": args.aa_scale,
                            **metadata, "runs": runs})
    return 0 if failed == 0 else 1
