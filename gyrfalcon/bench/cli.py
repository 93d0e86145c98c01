"""`gyrfalcon bench <kind>`: argparse only; each kind's module is imported when it runs.

A kind lives in gyrfalcon/bench/<kind>.py and defines two functions:
    add_cli_args(parser)   its flags (argparse only: the module's top level imports nothing heavy)
    main(args) -> int      the benchmark (heavy imports inside)
It is listed in BENCH_KINDS and registered when its module exists, so `latency` and `throughput`
plug in by adding their files.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util

BENCH_KINDS = {
    "serve": "benchmark a running OpenAI-compatible server (TTFT, TPOT, ITL, E2E, throughput)",
    "latency": "offline latency of one batch",
    "throughput": "offline throughput over many prompts",
    "make-checkpoint": "write a random-weight checkpoint of a real model's shape",
}


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="run a benchmark", description="Benchmarks: " + ", ".join(BENCH_KINDS))
    kinds = p.add_subparsers(dest="bench_kind", required=True)
    registered = []
    for kind, help_text in BENCH_KINDS.items():
        name = f"gyrfalcon.bench.{kind.replace('-', '_')}"
        if importlib.util.find_spec(name) is None:
            continue
        module = importlib.import_module(name)
        sp = kinds.add_parser(kind, help=help_text, description=(module.__doc__ or help_text).strip())
        module.add_cli_args(sp)
        sp.set_defaults(func=module.main)
        registered.append(kind)
    kinds.metavar = "{" + ",".join(registered) + "}"
    return p
