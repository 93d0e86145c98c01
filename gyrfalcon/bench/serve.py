"""Benchmark a running OpenAI-compatible server (gyrfalcon's, vLLM's, ...) over HTTP.

An asyncio client (aiohttp) sends --num-prompts streaming requests, at most --max-concurrency at a
time, arriving at --request-rate per second (Poisson; inf: all at once), and prints what
`vllm bench serve` prints: successful / failed requests, duration, request and token throughput,
and mean / median / P99 of time to first token (TTFT), time per output token after the first (TPOT),
inter-token latency (ITL) and end-to-end latency (E2EL). --save-result FILE writes them as JSON.

The random dataset sends prompts as token ids (exactly --input-len of them, drawn from the
tokenizer's vocabulary without its special tokens), so the input length is exact; the chat endpoint
gets their decoded text instead.
"""

from __future__ import annotations

import argparse
import sys


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="openai", choices=["openai", "openai-chat"],
                   help="openai: /v1/completions; openai-chat: /v1/chat/completions")
    p.add_argument("--base-url", default=None,
                   help="server URL, e.g. http://127.0.0.1:8000 (default: http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1", help="the server's host, when --base-url is not given")
    p.add_argument("--port", type=int, default=8000, help="the server's port, when --base-url is not given")
    p.add_argument("--endpoint", default=None, help="default: /v1/completions (/v1/chat/completions for openai-chat)")
    p.add_argument("--model", default=None, help="served model name (default: the server's first model)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer for the random dataset (default: the model's root path from /v1/models)")
    p.add_argument("--dataset-name", "--dataset", dest="dataset_name", default="random", choices=["random"],
                   help="random: prompts of random token ids")
    p.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    p.add_argument("--random-input-len", "--input-len", dest="input_len", type=int, default=1024,
                   help="prompt tokens per request")
    p.add_argument("--random-output-len", "--output-len", dest="output_len", type=int, default=128,
                   help="max_tokens per request")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly from [len * (1 - r), len * (1 + r)]")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second (inf: all at once, bounded by --max-concurrency)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals; 1 is Poisson")
    p.add_argument("--max-concurrency", type=int, default=None, help="the most requests in flight (default: no limit)")
    p.add_argument("--ignore-eos", action="store_true", help="ask for exactly --output-len tokens (ignore_eos)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of the requests")
    p.add_argument("--seed", type=int, default=0, help="seed of the dataset and the arrival times")
    p.add_argument("--api-key", default=None, help="default: $OPENAI_API_KEY")
    p.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles to report")
    p.add_argument("--save-result", default=None, metavar="FILE", help="write the results as JSON to FILE")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.add_argument("--timeout", type=float, default=6 * 3600, help="per-request timeout in seconds")


def main(args: argparse.Namespace) -> int:
    import asyncio

    from gyrfalcon.bench.serve_client import run_benchmark
    return asyncio.run(run_benchmark(args))


if __name__ == "__main__":  # python -m gyrfalcon.bench.serve ...
    ap = argparse.ArgumentParser(prog="gyrfalcon bench serve")
    add_cli_args(ap)
    sys.exit(main(ap.parse_args()))
