"""Which Triton kernel variants a GPU startup compiles, counted on a machine without a GPU.

Triton compiles one variant per kernel and specialization of its launch: the constexprs' values, and for the
other arguments a pointer's 16-byte alignment or an integer being 1 or a multiple of 16. With an empty
Triton cache a startup compiles every variant its eager runs launch, one after another: the activation
profile's prefill, then each captured size's warm-up run (the decode-graph ladder, batch 1 with and without
PDL, the one-split decode ladder, the prefill-graph ladder). On the GPU machine's host that was most of a
cold start: Llama-3.1-8B with 384 sequences started in 32.6 s on a fresh machine and 14.0 s with the cache
warm (run 36).

Here those same runs execute on the CPU through the runners' own `prepare` steps (runner/precompile.py's
ladder_warmup_steps, the list a startup warms up), with every Triton launch recorded instead of run (under
the interpreter, keyed by kernels/_specialization.launch_signature as the JIT tests key them) and the GEMMs
returning empty outputs, so a census takes seconds at any model's real shape. It prints the distinct
variants per kernel and per startup phase, and which sizes of each ladder brought new ones: the list to
shorten when cold starts are too slow. The count is exact for the specialization; whether a variant costs
0.1 or 1 s to compile is the GPU machine's business.

--compile-threads N [N ...] then compiles those steps' variants for sm_90 for real, through runner/precompile.py
(GYRFALCON_PARALLEL_COMPILE's path) with N threads, each N in a fresh process with an empty Triton cache and
a fake device (scripts/compile_check.py's harness), and times the compiles and the launcher builds: the
parallel compile checked and timed without a GPU, with whichever Triton is installed (PYTHONPATH can put
the GPU machine's 3.6 first; its launchers link against libcuda: TRITON_LIBCUDA_PATH may name a stub).

python3 benchmarks/startup_compiles.py --preset llama-3.1-8b --max-num-seqs 384 [--compile-threads 1 2]
    [--output-json FILE]
"""

from __future__ import annotations

import os
import sys

# Set before triton's first import. The census runs under the interpreter (launches become
# InterpretedFunction.run); a --compile-child process compiles for sm_90 for real (the --compile-threads mode).
_COMPILE_CHILD = "--compile-child" in sys.argv
if _COMPILE_CHILD:
    os.environ.pop("TRITON_INTERPRET", None)
else:
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import contextlib  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections import Counter, defaultdict  # noqa: E402
from typing import Callable, List, Tuple  # noqa: E402

import torch  # noqa: E402

NUM_LAYERS = 2  # the first layer differs (no residual into its norm); every later one repeats the second


@contextlib.contextmanager
def recorded_launches(seen: dict):
    """Inside, every Triton launch adds (kernel name, specialization) to `seen` (first phase that asked for it)
    and runs nothing; kernels launched with launch_pdl carry ("launch_pdl", True) in their key."""
    from triton.runtime.interpreter import InterpretedFunction

    from gyrfalcon.kernels._specialization import launch_signature

    orig = InterpretedFunction.run
    phase = [None]

    def run(self, *args, grid, warmup, **kwargs):
        key = launch_signature(self, args, kwargs)
        key += tuple((k, v) for k, v in sorted(kwargs.items()) if k in ("num_warps", "num_stages", "launch_pdl"))
        seen.setdefault((self.fn.__name__, key), phase[0])
    InterpretedFunction.run = run
    try:
        yield phase
    finally:
        InterpretedFunction.run = orig


@contextlib.contextmanager
def gpu_dispatch():
    """The model's layers take their GPU paths on CPU tensors: use_triton and pdl_possible answer as on an
    H200 (bound by name in many modules, so patched in each), decode attention sees the H200's 132 SMs, and
    torch GEMMs return empty outputs of the right shape (cuBLAS compiles nothing; the CPU would take minutes
    at real widths)."""
    import importlib

    import torch.nn.functional as F

    from gyrfalcon.kernels import _common as C

    # (importlib: the kernels package exports a function of the same name as this module)
    pda = importlib.import_module("gyrfalcon.kernels.paged_decode_attention")

    def pdl_possible(t):
        return C.gdc_wait is not None and not C._PDL_OFF[0] and C.pdl_mode() != "0"

    def linear(x, w, b=None):
        return torch.empty(*x.shape[:-1], w.shape[0], dtype=x.dtype)

    def matmul(a, b, *, out=None):
        return torch.empty(*a.shape[:-1], b.shape[-1], dtype=a.dtype)

    patches = [(F, "linear", linear), (torch, "matmul", matmul), (pda, "_sm_count", lambda device: 132)]
    for name, mod in list(sys.modules.items()):
        if name.startswith("gyrfalcon") and mod is not None:
            if getattr(mod, "use_triton", None) is C.use_triton:
                patches.append((mod, "use_triton", lambda t: C.HAS_TRITON))
            if getattr(mod, "pdl_possible", None) is C.pdl_possible:
                patches.append((mod, "pdl_possible", pdl_possible))
    old = [(m, a, getattr(m, a)) for m, a, _ in patches]
    for m, a, v in patches:
        setattr(m, a, v)
    try:
        yield
    finally:
        for m, a, v in old:
            setattr(m, a, v)


def shape_model(preset: str, max_model_len: int, num_layers=None, block_size: int = 16):
    """(model, kv_caches) of a preset's real widths on the CPU: bf16 torch.empty weights (nothing to fill, as
    nothing reads them for real here) and a small bf16 paged cache per layer (block counts only move pointers,
    never a launch's specialization)."""
    from gyrfalcon.bench.make_checkpoint import build_config
    from gyrfalcon.models.registry import resolve_model_class

    cfg = build_config(preset, num_layers=num_layers)
    torch.set_default_dtype(torch.bfloat16)
    model = resolve_model_class(cfg)(cfg, max_position=max_model_len).eval()
    torch.set_default_dtype(torch.float32)
    spec = model.kv_cache_spec()
    shape = (64, block_size, spec["num_kv_heads"], spec["head_dim"])
    kv = [(torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16))
          for _ in range(spec["num_layers"])]
    return model, kv


def startup_steps(preset: str, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                  block_size: int = 16) -> List[Tuple[str, int, Callable]]:
    """[(phase, size, step)]: the eager runs of a GPU startup of `preset` with these limits, in its order (the
    activation profile's prefill, then each ladder's warm-up runs as runner/precompile.py lists them), on CPU
    tensors. Call the steps inside gpu_dispatch()."""
    from gyrfalcon.runner import precompile
    from gyrfalcon.runner.cuda_graph import CudaGraphRunner, graph_logits_enabled
    from gyrfalcon.runner.mixed_graph import MixedGraphRunner, prefill_graphs_enabled
    from gyrfalcon.runner.model_runner import profile_step

    model, kv = shape_model(preset, max_model_len, NUM_LAYERS, block_size)
    spec = model.kv_cache_spec()
    last_sampled = torch.zeros(max(max_num_seqs, 8), dtype=torch.int64)
    cpu = torch.device("cpu")
    n = min(max_num_batched_tokens, max_model_len)
    caches = [(torch.zeros((-(-n // block_size), block_size, spec["num_kv_heads"], spec["head_dim"]),
                           dtype=torch.bfloat16),) * 2 for _ in range(spec["num_layers"])]
    out = [("activation profile prefill", n,
            functools.partial(profile_step, model, n, max_num_seqs, caches, block_size, cpu))]

    def ladder(name, sizes, prepare, batch1_pdl):
        steps = precompile.ladder_warmup_steps(sizes, kv, prepare, batch1_pdl)
        # Largest first, batch 1 last (twice where it is captured both with and without PDL).
        labels = [s for s in reversed(sizes) for _ in range(2 if s == 1 and len(steps) > len(sizes) else 1)]
        out.extend((name, size, step) for size, step in zip(labels, steps))

    gr = CudaGraphRunner(model, kv, max_num_seqs, max_model_len, block_size, cpu, last_sampled,
                         with_logits=graph_logits_enabled())
    with gpu_dispatch():  # (whether batch 1 is captured both ways asks pdl_possible)
        ladder("decode graphs", gr.sizes, gr.prepare, None)
        if gr.short_sizes:
            # The one-split ladder follows the timed batch-1 choice; PDL (Qwen3-0.6B's) compiles its variants.
            ladder("one-split decode graphs", gr.short_sizes, lambda b: gr.prepare(b, short=True), True)
        if prefill_graphs_enabled():
            mg = MixedGraphRunner(model, kv, max_num_batched_tokens, max_num_seqs, max_model_len, block_size, cpu,
                                  last_sampled)
            ladder("prefill graphs", mg.sizes, mg.prepare, None)
    return out


def census(preset: str, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int) -> dict:
    """{"variants": [(kernel, phase)], "by_phase": {phase: n}, "by_kernel": {kernel: n},
    "new_at": {phase: {size: n new}}} of the startup of `preset` with these limits."""
    steps = startup_steps(preset, max_num_seqs, max_num_batched_tokens, max_model_len)
    seen: dict = {}
    new_at: dict = defaultdict(dict)
    with gpu_dispatch(), recorded_launches(seen) as phase, torch.inference_mode():
        for name, size, step in steps:
            n0 = len(seen)
            phase[0] = name
            step()
            if name != "activation profile prefill":
                new_at[name][size] = new_at[name].get(size, 0) + len(seen) - n0
    variants = sorted(((k[0], p) for k, p in seen.items()))
    return {"variants": [list(v) for v in variants],
            "by_phase": dict(Counter(p for _, p in variants)),
            "by_kernel": dict(Counter(k for k, _ in variants).most_common()),
            "new_at": {ladder: {str(s): c for s, c in sorted(d.items()) if c} for ladder, d in new_at.items()}}


def compile_child(args) -> dict:
    """In this process (TRITON_INTERPRET unset): point Triton at a fake sm_90 device (scripts/compile_check.py's
    harness), then run the startup's steps through runner/precompile.py with args.compile_child threads, so
    every variant compiles for real, and the launchers are built where this Triton builds them (3.6, the GPU
    machine's: a C extension each, linked against libcuda, which TRITON_LIBCUDA_PATH can point at a stub on
    a machine without a driver); returns precompile's stats."""
    import importlib
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import compile_check
    from triton.runtime.jit import JITFunction

    real_run = JITFunction.run
    compile_check._harness(90)
    JITFunction.run = real_run  # the harness's compile-only launch: precompile brings its own
    for name in [m for m in sys.modules if m.startswith("gyrfalcon.kernels.") and not m.endswith("._common")]:
        importlib.reload(sys.modules[name])  # (the harness reloads the decode kernels; the prefill ones too)
    from triton.backends.nvidia import driver as nv

    if hasattr(nv, "make_launcher"):  # a Triton that builds a C launcher per signature
        launcher_cls = nv.CudaLauncher
    else:  # one generic launcher: nothing to build
        def launcher_cls(src, metadata):
            return None
    from gyrfalcon.runner.precompile import precompile

    steps = startup_steps(args.preset, args.max_num_seqs, args.max_num_batched_tokens, args.max_model_len)
    with gpu_dispatch(), torch.inference_mode():
        return precompile([step for _, _, step in steps], workers=args.compile_child, launcher_cls=launcher_cls)


def compile_times(args) -> list:
    """Per thread count of args.compile_threads, a child process with an empty Triton cache compiles the
    startup's variants through precompile: [{threads, kernels, launchers, compile_s, launcher_s, seconds}]."""
    out = []
    for n in args.compile_threads:
        with tempfile.TemporaryDirectory() as cache:
            cmd = [sys.executable, __file__, "--compile-child", str(n), "--preset", args.preset, "--max-num-seqs",
                   str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                   "--max-model-len", str(args.max_model_len)]
            r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TRITON_CACHE_DIR": cache})
            if r.returncode != 0:
                raise RuntimeError(f"compile child ({n} threads) failed:\n{r.stderr[-3000:]}")
            out.append({"threads": n, **json.loads(r.stdout.strip().splitlines()[-1])})
    return out


def main(argv=None) -> int:
    from gyrfalcon.bench.make_checkpoint import PRESETS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama-3.1-8b", choices=sorted(PRESETS))
    p.add_argument("--max-num-seqs", type=int, default=384)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--output-json", default=None)
    p.add_argument("--compile-threads", type=int, nargs="*", default=[],
                   help="also compile the variants for sm_90 through runner/precompile.py with each of these thread "
                        "counts, each in a fresh process with an empty Triton cache, and time it")
    p.add_argument("--compile-child", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.compile_child:
        print(json.dumps(compile_child(args)))
        return 0
    t0 = time.perf_counter()
    res = census(args.preset, args.max_num_seqs, args.max_num_batched_tokens, args.max_model_len)
    secs = time.perf_counter() - t0
    total = len(res["variants"])
    print(f"startup of {args.preset} ({args.max_num_seqs} sequences, {args.max_num_batched_tokens} tokens per step, "
          f"max_model_len {args.max_model_len}): {total} Triton kernel variants to compile (census in {secs:.1f} s)")
    print("by phase (where each variant is first launched): "
          + ", ".join(f"{ph} {n}" for ph, n in res["by_phase"].items()))
    print("by kernel: " + ", ".join(f"{k} {n}" for k, n in res["by_kernel"].items()))
    for ladder, d in res["new_at"].items():
        print(f"{ladder}, new variants by size: " + ", ".join(f"{s}: {c}" for s, c in d.items()))
    res["compile"] = compile_times(args)
    for c in res["compile"]:
        print(f"compiled for sm_90 with {c['threads']} threads: {c['kernels']} kernels in {c['compile_s']:.1f} s, then "
              f"{c['launchers']} launchers in {c['launcher_s']:.1f} s ({c['steps']} warm-up runs)")
    if args.output_json:
        from gyrfalcon.bench.common import run_info
        with open(args.output_json, "w") as f:
            import triton
            json.dump({**run_info(args), "triton": triton.__version__, "total_variants": total, "census_s": secs,
                       **res}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
