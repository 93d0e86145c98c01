"""Compile the Triton kernels a CUDA-graph ladder will launch in parallel threads, before capturing it.

Capturing a ladder runs each size's step once eagerly first (cuda_graph._capture), and the first launch
of each kernel variant compiles it on the calling thread (MLIR passes, LLVM, ptxas), one variant after
another. On the GPU machine's host with an empty Triton cache that is most of a cold start: Llama-3.1-8B
with 384 sequences started in 32.6 s on a fresh machine, 14.0 s in the next run of the same call, its
cache warm (benchmarks/results/throughput_*-h200-2026-12-01-run36.json). Here every size's step runs once with each
Triton launch turned into a compile-only warmup inside triton.AsyncCompileMode, which hands the compiles
to a thread pool (Triton's compiler passes release the GIL, ptxas is a subprocess); leaving the block
waits for them all, and the capture's own eager run then finds every variant compiled. The steps' torch
ops run as usual, on whatever the Triton outputs hold: a graph step reads nothing back on the host.

Off by default until measured: GYRFALCON_PARALLEL_COMPILE=1 turns it on (scripts/gpu_check.sh coldstart
times cold starts both ways, each with an empty Triton cache).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, List, Optional

from gyrfalcon.forward_context import forward_context
from gyrfalcon.kernels._common import pdl_disabled, pdl_mode, pdl_possible, pdl_warmup

logger = logging.getLogger(__name__)


def parallel_compile_enabled() -> bool:
    return os.environ.get("GYRFALCON_PARALLEL_COMPILE", "0") == "1"


@contextlib.contextmanager
def compile_only():
    """Inside, every Triton JIT launch (kernel[grid](...)) compiles or finds its variant and returns
    without launching (JITFunction.run with warmup=True)."""
    from triton.runtime.jit import JITFunction

    orig = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        return orig(self, *args, grid=grid, warmup=True, **kwargs)
    JITFunction.run = run
    try:
        yield
    finally:
        JITFunction.run = orig


def ladder_warmup_steps(sizes: List[int], kv_caches, prepare, batch1_pdl: Optional[bool]) -> List[Callable]:
    """One callable per eager run that cuda_graph.capture_ladder will make before its captures: each size's
    step under pdl_warmup (as _capture runs it), and batch 1 also with PDL off where the ladder captures it
    that way (batch1_pdl False) or both ways (None, in auto mode)."""
    out: List[Callable] = []

    def run(fb, step, pdl_off: bool):
        def go():
            with forward_context(fb, kv_caches), pdl_warmup(), (pdl_disabled() if pdl_off else
                                                                  contextlib.nullcontext()):
                step()
        return go
    for size in reversed(sizes):
        fb, step = prepare(size)
        both = size == 1 and batch1_pdl is None and pdl_mode() == "auto" and pdl_possible(fb.input_ids)
        out.append(run(fb, step, pdl_off=size == 1 and batch1_pdl is False))
        if both:
            out.append(run(fb, step, pdl_off=True))
    return out


def precompile(steps: Iterable[Callable], workers: Optional[int] = None) -> float:
    """Run each step with its Triton launches as compile-only warmups, the compiles spread over `workers`
    threads (default: the CPU count, at most 16); returns the seconds it took, compiles included."""
    import triton

    t0 = time.perf_counter()
    mode = getattr(triton, "AsyncCompileMode", None)
    workers = workers or min(16, os.cpu_count() or 1)
    with ThreadPoolExecutor(workers) as pool, (mode(pool) if mode is not None else contextlib.nullcontext()), \
            compile_only():
        n = 0
        for step in steps:
            step()
            n += 1
    secs = time.perf_counter() - t0
    logger.info("compiled the Triton kernels of %d warm-up runs in %.1f s (%d threads%s)", n, secs, workers,
                "" if mode is not None else "; this Triton has no AsyncCompileMode, so one at a time")
    return secs
