"""The client side of `gyrfalcon bench serve` (flags and docs in gyrfalcon/bench/serve.py)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Dict, List, Optional

import aiohttp
import numpy as np


@dataclass
class BenchRequest:
    prompt: Any  # token ids (completions) or text (chat)
    prompt_len: int
    output_len: int


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: List[float] = field(default_factory=list)
    token_times: List[float] = field(default_factory=list)  # absolute arrival times of content chunks
    error: str = ""


class ServerError(Exception):
    """The server cannot be used (unreachable, or it refused a request): reported in one line, not a traceback."""


def http_error_text(status: int, body: str) -> str:
    """`HTTP 401: <the error's message>` from an OpenAI-style error body (else the body's start), on one line."""
    message = body
    try:
        obj = json.loads(body)
        err = obj.get("error") if isinstance(obj, dict) else None
        if isinstance(err, dict) and err.get("message"):
            message = str(err["message"])
        elif isinstance(obj, dict) and obj.get("detail"):
            message = str(obj["detail"])
    except ValueError:
        pass
    return f"HTTP {status}: {' '.join(message.split())[:300]}"


async def _get_json(session: aiohttp.ClientSession, url: str, headers) -> Dict[str, Any]:
    try:
        async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=60)) as r:
            if r.status != 200:
                raise ServerError(f"GET {url}: {http_error_text(r.status, await r.text())}")
            return await r.json()
    except aiohttp.ClientConnectorError as e:
        errno = getattr(e.os_error, "errno", None)
        # asyncio words a refused connection "Connect call failed (addr)"; the errno's text says what happened.
        reason = os.strerror(errno) if errno and errno > 0 else (getattr(e.os_error, "strerror", None) or str(e))
        raise ServerError(f"cannot connect to {url}: {reason}") from None
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise ServerError(f"GET {url}: {type(e).__name__}: {e}") from None


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def random_requests(tokenizer, num: int, input_len: int, output_len: int, range_ratio: float, seed: int,
                    chat: bool) -> List[BenchRequest]:
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]

    def length(n: int) -> int:
        lo, hi = max(1, int(n * (1 - range_ratio))), max(1, int(n * (1 + range_ratio)))
        return rng.randint(lo, hi)

    out = []
    for _ in range(num):
        n_in, n_out = length(input_len), length(output_len)
        ids = [rng.choice(vocab) for _ in range(n_in)]
        out.append(BenchRequest(tokenizer.decode(ids) if chat else ids, n_in, n_out))
    return out


async def send_one(session: aiohttp.ClientSession, url: str, headers, payload: Dict[str, Any], chat: bool,
                   prompt_len: int, timeout: float) -> RequestResult:
    res = RequestResult(prompt_len=prompt_len)
    start = time.perf_counter()
    last = start
    chunks = 0
    try:
        async with session.post(url, json=payload, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            if r.status != 200:
                res.error = http_error_text(r.status, await r.text())
                return res
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                obj = json.loads(data)
                if obj.get("error"):
                    res.error = json.dumps(obj["error"])[:500]
                    return res
                if obj.get("usage"):
                    res.output_tokens = obj["usage"].get("completion_tokens", 0)
                for c in obj.get("choices") or []:
                    text = (c.get("delta") or {}).get("content") if chat else c.get("text")
                    if not text and not (not chat and c.get("logprobs")):
                        continue
                    now = time.perf_counter()
                    if chunks == 0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    res.token_times.append(now)
                    last = now
                    chunks += 1
        res.latency = time.perf_counter() - start
        if res.output_tokens == 0:
            res.output_tokens = chunks
        res.success = chunks > 0 or res.output_tokens > 0
        if not res.success:
            res.error = "no output"
    except Exception as e:  # noqa: BLE001: a failed request is a result, not a crash
        res.error = f"{type(e).__name__}: {e}"
    return res


_SPEC_COUNTERS = {"spec_decode_num_drafts": "num_drafts", "spec_decode_num_draft_tokens": "num_draft_tokens",
                  "spec_decode_num_accepted_tokens": "num_accepted_tokens"}


def spec_decode_counters(text: str) -> Optional[Dict[str, Any]]:
    """The speculative-decoding counters in a /metrics page (gyrfalcon's names, or vLLM's under `vllm:`), summed
    over their labels, in SpecDecodingStats.as_dict's keys; None when the server exposes none."""
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        return None
    out: Dict[str, Any] = {}
    per_pos: Dict[int, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            name = s.name.split(":", 1)[-1]
            if not name.endswith("_total"):
                continue  # (a counter's _created sample)
            name = name[:-len("_total")]
            if name == "spec_decode_num_accepted_tokens_per_pos":
                pos = int(s.labels.get("position", 0))
                per_pos[pos] = per_pos.get(pos, 0) + s.value
            elif name in _SPEC_COUNTERS:
                out[_SPEC_COUNTERS[name]] = out.get(_SPEC_COUNTERS[name], 0) + s.value
    if "num_drafts" not in out:
        return None
    out.setdefault("num_draft_tokens", 0)
    out.setdefault("num_accepted_tokens", 0)
    out["accepted_per_pos"] = [per_pos.get(i, 0) for i in range(max(per_pos) + 1)] if per_pos else []
    return out


async def _spec_counters(session: aiohttp.ClientSession, base: str, headers) -> Optional[Dict[str, Any]]:
    """The server's speculative-decoding counters now (None: no /metrics, or no speculation there)."""
    try:
        async with session.get(base + "/metrics", headers=headers,
                               timeout=aiohttp.ClientTimeout(total=10)) as resp:
            if resp.status != 200:
                return None
            return spec_decode_counters(await resp.text())
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None


def _stats(values: List[float], percentiles: List[float]) -> Dict[str, float]:
    a = np.asarray(values, dtype=np.float64) * 1000.0 if values else np.zeros(1)
    out = {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std())}
    for p in percentiles:
        out[f"p{p:g}"] = float(np.percentile(a, p))
    return out


def summarize(results: List[RequestResult], duration: float, percentiles: List[float]) -> Dict[str, Any]:
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [x for r in ok for x in r.itl]
    # Peak tokens per second over 1 s windows. A chunk may carry several tokens or (an unfinished
    # character, text held back for a stop string) none: spread each request's tokens over its chunks.
    times = np.asarray([t for r in ok for t in r.token_times])
    weights = np.asarray([r.output_tokens / len(r.token_times) for r in ok for _ in r.token_times])
    peak = 0.0
    if times.size:
        buckets = np.floor(times - times.min()).astype(np.int64)
        peak = float(np.bincount(buckets, weights=weights).max())
    m: Dict[str, Any] = {
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration, "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration, "max_output_tokens_per_s": peak}
    for name, vals in (("ttft", [r.ttft for r in ok]), ("tpot", tpots), ("itl", itls),
                       ("e2el", [r.latency for r in ok])):
        for k, v in _stats(vals, percentiles).items():
            m[f"{k}_{name}_ms"] = v
    return m


def print_report(m: Dict[str, Any], args, percentiles: List[float]) -> None:
    w = 50
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w, c="="))
    rows = [("Successful requests:", m["completed"]), ("Failed requests:", m["failed"]),
            ("Maximum request concurrency:", args.max_concurrency),
            ("Request rate configured (RPS):", args.request_rate),
            ("Benchmark duration (s):", f"{m['duration']:.2f}"),
            ("Total input tokens:", m["total_input_tokens"]), ("Total generated tokens:", m["total_output_tokens"]),
            ("Request throughput (req/s):", f"{m['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{m['output_throughput']:.2f}"),
            ("Peak output token throughput (tok/s):", f"{m['max_output_tokens_per_s']:.2f}"),
            ("Total Token throughput (tok/s):", f"{m['total_token_throughput']:.2f}")]
    for k, v in rows:
        print("{:<40} {:<10}".format(k, str(v)))
    for name, title, label in (("ttft", "Time to First Token", "TTFT"),
                               ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
                               ("itl", "Inter-token Latency", "ITL"), ("e2el", "End-to-end Latency", "E2EL")):
        print("{s:{c}^{n}}".format(s=title, n=w, c="-"))
        print("{:<40} {:<10.2f}".format(f"Mean {label} (ms):", m[f"mean_{name}_ms"]))
        print("{:<40} {:<10.2f}".format(f"Median {label} (ms):", m[f"median_{name}_ms"]))
        for p in percentiles:
            print("{:<40} {:<10.2f}".format(f"P{p:g} {label} (ms):", m[f"p{p:g}_{name}_ms"]))
    sd = m.get("spec_decode")
    if sd is not None:
        print("{s:{c}^{n}}".format(s="Speculative Decoding", n=w, c="-"))
        for k, v in (("Acceptance rate (%):", f"{100 * sd['acceptance_rate']:.2f}"),
                     ("Acceptance length:", f"{sd['mean_acceptance_length']:.2f}"),
                     ("Drafts:", int(sd["num_drafts"])), ("Draft tokens:", int(sd["num_draft_tokens"])),
                     ("Accepted tokens:", int(sd["num_accepted_tokens"]))):
            print("{:<40} {:<10}".format(k, str(v)))
        print("Per-position acceptance (%): " + ", ".join(f"{100 * a:.2f}" for a in sd["acceptance_per_pos"]))
    print("=" * w)


async def run_benchmark(args) -> int:
    chat = args.backend == "openai-chat"
    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    endpoint = args.endpoint or ("/v1/chat/completions" if chat else "/v1/completions")
    key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    try:
        async with aiohttp.ClientSession() as session:
            models = await _get_json(session, base + "/v1/models", headers)
    except ServerError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    model = args.model or models["data"][0]["id"]
    tok_path = args.tokenizer
    if tok_path is None:
        roots = [m.get("root") for m in models["data"] if m["id"] == model] + [model]
        tok_path = next((r for r in roots if r and os.path.isdir(r)), None)
        if tok_path is None:
            print("error: cannot find the tokenizer; pass --tokenizer PATH", file=sys.stderr, flush=True)
            return 2
    try:
        tokenizer = _load_tokenizer(tok_path)
    except (OSError, ValueError) as e:
        print(f"error: cannot load the tokenizer from {tok_path}: {' '.join(str(e).split())[:300]}",
              file=sys.stderr, flush=True)
        return 2
    reqs = random_requests(tokenizer, args.num_prompts, args.input_len, args.output_len,
                           args.random_range_ratio, args.seed, chat)
    # A fresh session after the (slow) setup: a pooled connection idle past the server's
    # keep-alive timeout would be closed under the first request.
    conn = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, force_close=False)
    async with aiohttp.ClientSession(connector=conn, read_bufsize=1 << 20) as session:

        def payload(r: BenchRequest) -> Dict[str, Any]:
            body: Dict[str, Any] = {"model": model, "max_tokens": r.output_len, "temperature": args.temperature,
                                    "stream": True, "stream_options": {"include_usage": True}}
            if args.ignore_eos:
                body["ignore_eos"] = True
            if chat:
                body["messages"] = [{"role": "user", "content": r.prompt}]
            else:
                body["prompt"] = r.prompt
            return body

        url = base + endpoint
        print("Starting initial single prompt test run...", flush=True)
        test = await send_one(session, url, headers, {**payload(reqs[0]), "max_tokens": min(reqs[0].output_len, 4)},
                              chat, reqs[0].prompt_len, args.timeout)
        if not test.success:
            print(f"error: the test request to {url} failed: {test.error}", file=sys.stderr, flush=True)
            return 1
        print("Initial test run completed. Starting main benchmark run...", flush=True)
        print(f"Traffic request rate: {args.request_rate}\nBurstiness factor: {args.burstiness}\n"
              f"Maximum request concurrency: {args.max_concurrency}", flush=True)

        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        bar = None
        if not args.disable_tqdm:
            try:
                from tqdm.auto import tqdm
                bar = tqdm(total=len(reqs))
            except ImportError:
                pass

        async def limited(r: BenchRequest) -> RequestResult:
            if sem is None:
                res = await send_one(session, url, headers, payload(r), chat, r.prompt_len, args.timeout)
            else:
                async with sem:
                    res = await send_one(session, url, headers, payload(r), chat, r.prompt_len, args.timeout)
            if bar is not None:
                bar.update(1)
            return res

        # The server's speculative-decoding counters around the timed run (vLLM's bench serve reads the same).
        spec_before = await _spec_counters(session, base, headers)
        rng = np.random.default_rng(args.seed)
        start = time.perf_counter()
        tasks = []
        for i, r in enumerate(reqs):
            tasks.append(asyncio.create_task(limited(r)))
            if args.request_rate != float("inf") and i + 1 < len(reqs):
                theta = 1.0 / (args.request_rate * args.burstiness)
                await asyncio.sleep(float(rng.gamma(args.burstiness, theta)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        if bar is not None:
            bar.close()
        spec_after = await _spec_counters(session, base, headers) if spec_before is not None else None

    m = summarize(results, duration, percentiles)
    if spec_after is not None:
        from gyrfalcon.engine.spec_stats import spec_decode_summary
        sd = spec_decode_summary(spec_before, spec_after)
        if sd is not None:
            m["spec_decode"] = sd
    print_report(m, args, percentiles)
    errors = [r.error for r in results if not r.success]
    if errors:
        print(f"First error: {errors[0]}")
    if args.save_result:
        out = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": args.backend, "endpoint": endpoint,
               "model_id": model, "tokenizer_id": tok_path, "dataset_name": args.dataset_name,
               "num_prompts": args.num_prompts, "random_input_len": args.input_len,
               "random_output_len": args.output_len, "random_range_ratio": args.random_range_ratio,
               "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
               "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
               "ignore_eos": args.ignore_eos, **m,
               "input_lens": [r.prompt_len for r in results], "output_lens": [r.output_tokens for r in results],
               "ttfts": [r.ttft for r in results], "errors": errors}
        d = os.path.dirname(os.path.abspath(args.save_result))
        os.makedirs(d, exist_ok=True)
        with open(args.save_result, "w") as f:
            json.dump(out, f, indent=2)
        print(f"Saved the results to {args.save_result}")
    return 0 if m["failed"] == 0 else 1
