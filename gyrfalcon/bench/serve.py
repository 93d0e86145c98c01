"""Benchmark a running OpenAI-compatible server (gyrfalcon's, vLLM's, ...) over HTTP; `vllm bench serve`'s command
lines run as they are.

An asyncio client (aiohttp) sends --num-prompts streaming requests, at most --max-concurrency at a time, arriving at
--request-rate per second (Poisson; inf: all at once), after --num-warmups unmeasured ones, and prints what
`vllm bench serve` prints: successful / failed requests, duration, request throughput (and goodput under --goodput
SLOs), token throughput, and mean / median / --metric-percentiles of the --percentile-metrics among time to first
token (TTFT), time per output token after the first (TPOT), inter-token latency (ITL) and end-to-end latency (E2EL).
--save-result writes them as JSON with vLLM's keys (to --result-dir / --result-filename).

Datasets (gyrfalcon/bench/serve_datasets.py): random (token-id prompts of exact lengths), sharegpt (a local JSON
file) and prefix-repetition. --profile aa runs Artificial Analysis's workloads instead (serve_aa.py).
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
    p.add_argument("--dataset-name", "--dataset", dest="dataset_name", default="random",
                   choices=["random", "sharegpt", "prefix-repetition"],
                   help="random: prompts of random token ids; sharegpt: the conversations of --dataset-path; "
                        "prefix-repetition: a few shared prefixes, each with fresh suffixes")
    p.add_argument("--dataset-path", default=None, help="the ShareGPT JSON file (--dataset-name sharegpt)")
    p.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    p.add_argument("--random-input-len", "--input-len", dest="input_len", type=int, default=1024,
                   help="prompt tokens per request (random)")
    p.add_argument("--random-output-len", "--output-len", dest="output_len", type=int, default=128,
                   help="max_tokens per request (random)")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="random: lengths drawn uniformly from [len * (1 - r), len * (1 + r)], r in [0, 1)")
    p.add_argument("--random-prefix-len", type=int, default=0,
                   help="random: tokens of one random prefix every prompt starts with, before its own tokens")
    p.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="sharegpt: max_tokens of every request (default: the length of the conversation's reply)")
    p.add_argument("--prefix-repetition-prefix-len", type=int, default=256, help="prefix-repetition: prefix tokens")
    p.add_argument("--prefix-repetition-suffix-len", type=int, default=256,
                   help="prefix-repetition: fresh tokens after the prefix")
    p.add_argument("--prefix-repetition-num-prefixes", type=int, default=10,
                   help="prefix-repetition: distinct prefixes, shared by the requests in turn")
    p.add_argument("--prefix-repetition-output-len", type=int, default=128, help="prefix-repetition: max_tokens")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second (inf: all at once, bounded by --max-concurrency)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals; 1 is Poisson")
    p.add_argument("--max-concurrency", type=int, default=None, help="the most requests in flight (default: no limit)")
    p.add_argument("--ignore-eos", action="store_true", help="ask for exactly --output-len tokens (ignore_eos)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of the requests")
    p.add_argument("--seed", type=int, default=0, help="seed of the dataset and the arrival times")
    p.add_argument("--api-key", default=None, help="default: $OPENAI_API_KEY")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                   help="comma-separated metrics to report percentiles of: ttft, tpot, itl, e2el")
    p.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles to report")
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs in milliseconds (ttft:500 tpot:50 e2el:5000): request goodput counts the requests "
                        "that meet all of them")
    p.add_argument("--num-warmups", type=int, default=0,
                   help="unmeasured requests (from the dataset) sent before the benchmark")
    p.add_argument("--save-result", nargs="?", const=True, default=None, metavar="FILE",
                   help="write the results as JSON, to --result-dir / --result-filename (vLLM's form) or to FILE")
    p.add_argument("--save-detailed", action="store_true",
                   help="with --save-result: also every request's input / output length, TTFT, ITLs and errors")
    p.add_argument("--result-dir", default=None, help="the folder of --save-result's file (default: .)")
    p.add_argument("--result-filename", default=None,
                   help="--save-result's file name (default: <backend>-<rate>qps[-concurrency<N>]-<model>-<date>.json)")
    p.add_argument("--label", default=None, help="the result's label, and its file name's start instead of the "
                                                 "backend")
    p.add_argument("--metadata", nargs="*", default=None, metavar="KEY=VALUE",
                   help="extra KEY=VALUE pairs stored in the result file")
    p.add_argument("--profile", nargs="?", const="", default=None, metavar="aa",
                   help="aa: Artificial Analysis's workloads (100 in / 300 out, 1k / 1k, 10k / 1.5k tokens, a fresh "
                        "prompt every request) at concurrency 1 and 10, reporting output speed (tokens after the "
                        "first chunk / time after it) and TTFT as P50 / P90; the dataset flags are ignored")
    p.add_argument("--aa-scale", type=float, default=1.0,
                   help="--profile aa: multiply every workload's input and output lengths (0.01: a quick check)")
    p.add_argument("--aa-workloads", default="100:300,1000:1000,10000:1500",
                   help="--profile aa: comma-separated INPUT:OUTPUT token lengths")
    p.add_argument("--aa-concurrency", default="1,10", help="--profile aa: comma-separated concurrencies")
    p.add_argument("--aa-requests-per-stream", type=int, default=5,
                   help="--profile aa: requests each concurrent stream sends per workload (10 streams: 10x as many)")
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
