"""Shared pieces of the offline benchmarks: prompts, run metadata, JSON output, tables."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List

# H200 HBM read bandwidth measured on the benchmark machine (GPU.md): a reduction over 1 GiB.
HBM_BYTES_PER_S = 4.15e12


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output-json", default=None, help="write the results here")
    p.add_argument("--baseline", choices=["hf"], default=None,
                   help="also run Hugging Face transformers on the same checkpoint and print ratios")


def random_prompts(n: int, length: int, vocab: int, seed: int) -> List[List[int]]:
    import random

    rng = random.Random(seed)
    # Distinct first tokens keep prompts from sharing cached prefixes by accident.
    return [[(i * 7919 + 13) % vocab] + [rng.randrange(vocab) for _ in range(length - 1)] for i in range(n)]


def run_info(args: argparse.Namespace) -> dict:
    """GPU, commit, command and date of a benchmark run. The commit is GYRFALCON_COMMIT when set (a copy
    of the tree on another machine may carry a stale .git), else git's HEAD, marked -dirty when the
    tree differs from it."""
    commit = os.environ.get("GYRFALCON_COMMIT", "")
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
    return {"gpu": gpu or "cpu", "commit": commit, "command": " ".join(["gyrfalcon"] + sys.argv[1:]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "args": {k: v for k, v in vars(args).items() if k != "func"}}


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
