"""The engine's host cost per decode step at high concurrency, and what the cyclic garbage collector takes of it.

A model (the bundled demo model by default, 8 layers of 384; --tiny: a 1-layer random one, whose forward costs next
to nothing) decodes --batch requests of --output-len tokens each through the offline LLM, so the host's per-request
work (scheduling, input packing, sampling metadata, output processing) is a large share of each step. Two modes,
alternated --repeats times in one process: `gc=run-freeze` (the default: LLM.generate freezes what is alive for the
run, engine.gc_frozen_while_running) and `gc=plain` (GYRFALCON_GC_FREEZE=0). Prints each run's milliseconds per step
and the collector's share (timed with gc.callbacks), and writes them as JSON.

    PYTHONPATH=$PWD python3 benchmarks/host_step.py --tiny [--live-objects N | --transformers-model] \\
        --output-json /tmp/host_step.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time

# Run as a script, this folder is sys.path[0], and its kernels.py would shadow the `kernels` package that
# transformers imports: drop it.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != _here]

import torch  # noqa: E402

from gyrfalcon import LLM, SamplingParams, envs  # noqa: E402
from gyrfalcon.config import demo_model_path  # noqa: E402


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


class GcClock:
    """Seconds spent in collections since the last reset (gc.callbacks' start / stop pairs)."""

    def __init__(self) -> None:
        self.seconds, self.count, self._t0 = 0.0, 0, 0.0
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0
            self.count += 1

    def reset(self) -> None:
        self.seconds, self.count = 0.0, 0


def _tiny_checkpoint(tokenizer_from: str) -> str:
    import shutil
    import tempfile

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tempfile.mkdtemp(prefix="host_step_tiny_")
    tok = AutoTokenizer.from_pretrained(tokenizer_from)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    gen = os.path.join(tokenizer_from, "generation_config.json")
    if os.path.exists(gen):
        shutil.copy(gen, out)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a checkpoint (default: the bundled demo model)")
    ap.add_argument("--tiny", action="store_true",
                    help="a random 1-layer Llama of width 32 with the demo model's tokenizer instead: the forward costs "
                         "next to nothing, so the steps show the host's own work")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=384, help="concurrent requests (max_num_seqs)")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--live-objects", type=int, default=0,
                    help="small containers kept alive during the runs: a process holding other state (a notebook, "
                         "a test suite, a transformers model next to the engine), which every full collection walks")
    ap.add_argument("--transformers-model", action="store_true",
                    help="also keep the checkpoint loaded by transformers in the process")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)  # the host's own cost, not the forward's threads
    model = args.model or str(demo_model_path())
    if args.tiny:
        model = _tiny_checkpoint(str(demo_model_path()))
    llm = LLM(model, device=args.device, max_num_seqs=args.batch, max_model_len=args.input_len + args.output_len + 8)
    vocab = llm.engine.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(10, vocab, (args.input_len,), generator=g).tolist()}
               for _ in range(args.batch)]
    sp = SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True)
    ballast = [{"i": [i]} for i in range(args.live_objects)]  # noqa: F841 (kept alive on purpose)
    if args.transformers_model:  # the same checkpoint loaded by transformers too, as a comparison script would
        from transformers import AutoModelForCausalLM
        ballast.append(AutoModelForCausalLM.from_pretrained(model))
    llm.generate(prompts[:8], sp, use_tqdm=False)  # warm-up
    clock = GcClock()
    runs = []
    for _ in range(args.repeats):
        for mode, env in (("plain", "0"), ("run-freeze", None)):
            if env is None:
                os.environ.pop("GYRFALCON_GC_FREEZE", None)
            else:
                os.environ["GYRFALCON_GC_FREEZE"] = env
            envs.refresh()
            clock.reset()
            t0 = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            dt = time.perf_counter() - t0
            runs.append({"gc": mode, "ms_per_step": dt * 1e3 / args.output_len,
                         "gc_ms_per_step": clock.seconds * 1e3 / args.output_len, "collections": clock.count,
                         "output_tok_s": args.batch * args.output_len / dt})
            r = runs[-1]
            print(f"gc={mode:10s} {r['ms_per_step']:6.2f} ms/step (GC {r['gc_ms_per_step']:.2f} ms in "
                  f"{r['collections']} collections), {r['output_tok_s']:,.0f} tok/s")
    med = {m: statistics.median(r["ms_per_step"] for r in runs if r["gc"] == m) for m in ("plain", "run-freeze")}
    print(f"median: plain {med['plain']:.2f} ms/step, run-freeze {med['run-freeze']:.2f} ms/step "
          f"({med['plain'] / med['run-freeze']:.2f}x)")
    if args.output_json:
        out = {"benchmark": "host_step", "device": args.device if args.device != "cpu" else platform.processor()
               or "cpu", "commit": _commit(), "command": " ".join(["python3"] + sys.argv),
               "date": datetime.date.today().isoformat(), "model": model, "batch": args.batch,
               "output_len": args.output_len, "temperature": args.temperature,
               "live_objects": args.live_objects, "transformers_model": args.transformers_model, "runs": runs,
               "median_ms_per_step": med, "speedup": med["plain"] / med["run-freeze"]}
        with open(args.output_json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
