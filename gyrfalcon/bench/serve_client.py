"""The client side of `gyrfalcon bench serve` (flags and docs in gyrfalcon/bench/serve.py)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from datetime import datetime
from typing import Any, Dict, List, Optional

import aiohttp
import numpy as np

from gyrfalcon.bench.serve_datasets import BenchRequest, DatasetError, build_requests
from gyrfalcon.bench.serve_report import (RequestResult, parse_goodput, parse_metadata, parse_percentile_metrics,
                                          print_report, result_path, spec_decode_counts, spec_decode_summary,
                                          summarize, write_result)


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
                    res.server_prompt_tokens = obj["usage"].get("prompt_tokens", 0)
                for c in obj.get("choices") or []:
                    text = (c.get("delta") or {}).get("content") if chat else c.get("text")
                    if not text and not (not chat and c.get("logprobs")):
                        continue
                    now = time.perf_counter()
                    if chunks == 0:
                        res.ttft = now - start
                        res.first_chunk_text = text or ""
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


class Target:
    """Where and how requests go: the URL, headers, served model, endpoint kind and the sampling fields."""

    def __init__(self, args, base: str, endpoint: str, headers: Dict[str, str], model: str, chat: bool) -> None:
        self.base, self.url, self.headers, self.model, self.chat = base, base + endpoint, headers, model, chat
        self.temperature, self.ignore_eos, self.timeout = args.temperature, args.ignore_eos, args.timeout

    def payload(self, r: BenchRequest) -> Dict[str, Any]:
        body: Dict[str, Any] = {"model": self.model, "max_tokens": r.output_len, "temperature": self.temperature,
                                "stream": True, "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.chat:
            body["messages"] = [{"role": "user", "content": r.prompt}]
        else:
            body["prompt"] = r.prompt
        return body

    async def send(self, session, r: BenchRequest, **override) -> RequestResult:
        return await send_one(session, self.url, self.headers, {**self.payload(r), **override}, self.chat,
                              r.prompt_len, self.timeout)


async def run_requests(session, target: Target, reqs: List[BenchRequest], max_concurrency: Optional[int],
                       request_rate: float = float("inf"), burstiness: float = 1.0, seed: int = 0,
                       bar=None) -> tuple:
    """Send `reqs` (at most max_concurrency in flight, arriving at request_rate per second with gamma(burstiness)
    gaps); (results in the order of reqs, the seconds from the first send to the last answer)."""
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def limited(r: BenchRequest) -> RequestResult:
        if sem is None:
            res = await target.send(session, r)
        else:
            async with sem:
                res = await target.send(session, r)
        if bar is not None:
            bar.update(1)
        return res

    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    tasks = []
    for i, r in enumerate(reqs):
        tasks.append(asyncio.create_task(limited(r)))
        if request_rate != float("inf") and i + 1 < len(reqs):
            theta = 1.0 / (request_rate * burstiness)
            await asyncio.sleep(float(rng.gamma(burstiness, theta)))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


async def connect(args):
    """(target, tokenizer, tokenizer path) for args, or an exit status after an `error:` line."""
    chat = args.backend == "openai-chat"
    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    endpoint = args.endpoint or ("/v1/chat/completions" if chat else "/v1/completions")
    key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
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
    return Target(args, base, endpoint, headers, model, chat), tokenizer, tok_path


async def scrape_spec_decode(session: aiohttp.ClientSession, target: Target) -> Dict[str, Any]:
    """The server's speculative-decoding counters now (serve_report.spec_decode_counts); {} from a server without
    them or without /metrics: the report then has no acceptance section."""
    try:
        async with session.get(target.base + "/metrics", headers=target.headers,
                               timeout=aiohttp.ClientTimeout(total=30)) as r:
            return spec_decode_counts(await r.text()) if r.status == 200 else {}
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return {}


def new_session() -> aiohttp.ClientSession:
    # A fresh session after the (slow) setup: a pooled connection idle past the server's keep-alive timeout would
    # be closed under the first request.
    conn = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, force_close=False)
    return aiohttp.ClientSession(connector=conn, read_bufsize=1 << 20)


def check_args(args) -> None:
    """ValueError for flags that cannot work, before anything connects or loads."""
    parse_percentile_metrics(args.percentile_metrics)
    parse_goodput(args.goodput)
    parse_metadata(args.metadata)
    try:
        [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--metric-percentiles {args.metric_percentiles!r}: expected numbers.") from None
    if args.profile == "":
        raise ValueError("--profile without a value is vLLM's torch-profiler switch, which gyrfalcon bench serve does "
                         "not have; --profile aa runs Artificial Analysis's workloads.")
    if args.profile not in (None, "aa"):
        raise ValueError(f"--profile {args.profile!r}: the one profile is aa (Artificial Analysis's workloads).")
    if args.profile == "aa":
        from gyrfalcon.bench.serve_aa import parse_profile_args
        parse_profile_args(args)
    elif args.dataset_name == "sharegpt" and not args.dataset_path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path FILE (a ShareGPT JSON file).")


async def run_benchmark(args) -> int:
    try:
        check_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    metrics = parse_percentile_metrics(args.percentile_metrics)
    goodput = parse_goodput(args.goodput)
    metadata = parse_metadata(args.metadata)
    got = await connect(args)
    if isinstance(got, int):
        return got
    target, tokenizer, tok_path = got
    if args.profile == "aa":
        from gyrfalcon.bench.serve_aa import run_aa_profile
        return await run_aa_profile(args, target, tokenizer, tok_path, metadata)
    try:
        reqs = build_requests(args, tokenizer, target.chat)
    except DatasetError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    async with new_session() as session:
        print("Starting initial single prompt test run...", flush=True)
        test = await target.send(session, reqs[0], max_tokens=min(reqs[0].output_len, 4))
        if not test.success:
            print(f"error: the test request to {target.url} failed: {test.error}", file=sys.stderr, flush=True)
            return 1
        print("Initial test run completed.", flush=True)
        if args.num_warmups > 0:
            print(f"Warming up with {args.num_warmups} requests...", flush=True)
            warm = [reqs[i % len(reqs)] for i in range(args.num_warmups)]
            await run_requests(session, target, warm, args.max_concurrency)
            print("Warmup run completed.", flush=True)
        print("Starting main benchmark run...", flush=True)
        print(f"Traffic request rate: {args.request_rate}\nBurstiness factor: {args.burstiness}\n"
              f"Maximum request concurrency: {args.max_concurrency}", flush=True)
        bar = None
        if not args.disable_tqdm:
            try:
                from tqdm.auto import tqdm
                bar = tqdm(total=len(reqs))
            except ImportError:
                pass
        spec_before = await scrape_spec_decode(session, target)
        results, duration = await run_requests(session, target, reqs, args.max_concurrency, args.request_rate,
                                               args.burstiness, args.seed, bar)
        if bar is not None:
            bar.close()
        spec_after = await scrape_spec_decode(session, target)

    m = summarize(results, duration, percentiles, metrics, goodput)
    m.update(spec_decode_summary(spec_before, spec_after))
    print_report(m, args, percentiles, metrics)
    errors = [r.error for r in results if not r.success]
    if errors:
        print(f"First error: {errors[0]}")
    path = result_path(args, target.model)
    if path:
        out = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": args.backend,
               "endpoint": target.url, "label": args.label, "model_id": target.model, "tokenizer_id": tok_path,
               "dataset_name": args.dataset_name, "num_prompts": args.num_prompts,
               "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
               "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
               "num_warmups": args.num_warmups, "ignore_eos": args.ignore_eos,
               "percentile_metrics": ",".join(metrics), "metric_percentiles": args.metric_percentiles,
               "goodput": goodput or None, **metadata, **m}
        if args.dataset_name == "random":
            out.update(random_input_len=args.input_len, random_output_len=args.output_len,
                       random_range_ratio=args.random_range_ratio, random_prefix_len=args.random_prefix_len)
        if args.save_detailed:
            out.update(input_lens=[r.prompt_len for r in results], output_lens=[r.output_tokens for r in results],
                       ttfts=[r.ttft for r in results], itls=[r.itl for r in results], errors=errors)
        write_result(path, out)
    return 0 if m["failed"] == 0 else 1
