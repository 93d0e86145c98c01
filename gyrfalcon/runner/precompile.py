"""Compile the Triton kernels a startup phase will launch in parallel threads, before running it.

Capturing a ladder runs each size's step once eagerly first (cuda_graph._capture), and the first launch
of each kernel variant compiles it on the calling thread (MLIR passes, LLVM, ptxas), then builds its
launcher (Triton 3.6, the GPU machine's: a C extension per argument signature, through the C compiler),
one variant after another. With an empty Triton cache that is most of a cold start: a startup compiles a few
dozen variants (the activation profile's prefill, the decode ladder, the one-split and prefill ladders).

Here each step runs once with each Triton launch turned into a compile-only warmup inside
triton.AsyncCompileMode, which hands the compiles to a thread pool (Triton's compiler passes release the
GIL, ptxas is a subprocess); leaving the block waits for them all, then the new kernels' launchers are
built in the same pool, and the phase's own eager run finds every variant compiled and its launcher in the
cache. The steps' torch ops run as usual, on whatever the Triton outputs hold: a graph step reads nothing
back on the host. The activation profile (model_runner) and each graph ladder (cuda_graph.capture_ladder)
precompile this way. With an empty Triton cache it cuts a cold start by about a third (measured on the
H200; docs/performance.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, List, Optional

from gyrfalcon.forward_context import forward_context
from gyrfalcon.kernels.common import pdl_disabled, pdl_mode, pdl_possible, pdl_warmup

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def compile_only(results: Optional[list] = None):
    """Inside, every Triton JIT launch (kernel[grid](...)) compiles or finds its variant and returns
    without launching (JITFunction.run with warmup=True); `results` (if given) collects what each returned:
    a CompiledKernel, or inside an AsyncCompileMode a FutureKernel for a new compile."""
    from triton.runtime.jit import JITFunction

    orig = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        k = orig(self, *args, grid=grid, warmup=True, **kwargs)
        if results is not None:
            results.append(k)
        return k
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


def build_launchers(kernels: List, pool, launcher_cls=None) -> int:
    """Build each compiled kernel's launcher in `pool`'s threads; returns how many were built.

    A compiled kernel makes its launcher at its first real launch (CompiledKernel._init_handles). Triton 3.6,
    the GPU machine's, generates a C extension per argument signature there and builds it with the C compiler
    (about 0.45 s each on this 2-core CI host, one after another on the main thread at startup); newer Tritons
    use one generic launcher and build nothing. Either way the result lands in Triton's cache, so building
    them here, in parallel, leaves the main thread's later _init_handles a cache hit."""
    kernels = [k for k in kernels if hasattr(k, "metadata") and getattr(k, "_run", None) is None]
    if kernels and launcher_cls is None:
        from triton.runtime import driver
        launcher_cls = driver.active.launcher_cls

    def build(k):
        launcher_cls(k.src, k.metadata)
    futures = [pool.submit(build, k) for k in kernels]
    for f in futures:
        f.result()
    return len(futures)


def precompile(steps: Iterable[Callable], workers: Optional[int] = None, launcher_cls=None) -> dict:
    """Run each step with its Triton launches as compile-only warmups, the compiles, then the new kernels'
    launchers, spread over `workers` threads (default: the CPU count, at most 16). Returns {"steps",
    "kernels" (compiled or found), "launchers" (built), "compile_s", "launcher_s", "seconds"}. launcher_cls:
    the driver's (tests pass their own)."""
    import triton

    t0 = time.perf_counter()
    mode_cls = getattr(triton, "AsyncCompileMode", None)
    workers = workers or min(16, os.cpu_count() or 1)
    launched: list = []
    with ThreadPoolExecutor(workers) as pool:
        with (mode_cls(pool) if mode_cls is not None else contextlib.nullcontext()), compile_only(launched):
            n = 0
            for step in steps:
                step()
                n += 1
        # Leaving the mode waited for every compile: each FutureKernel now holds its CompiledKernel.
        future_cls = getattr(triton, "FutureKernel", ())
        kernels = {id(k): k for k in (r.kernel if isinstance(r, future_cls) else r for r in launched)
                   if k is not None}
        t1 = time.perf_counter()
        launchers = build_launchers(list(kernels.values()), pool, launcher_cls)
    secs = time.perf_counter() - t0
    logger.info("compiled the Triton kernels of %d warm-up runs in %.1f s, then %d launchers in %.1f s (%d threads%s)",
                n, t1 - t0, launchers, secs - (t1 - t0), workers,
                "" if mode_cls is not None else "; this Triton has no AsyncCompileMode, so one at a time")
    return {"steps": n, "kernels": len(kernels), "launchers": launchers, "compile_s": t1 - t0,
            "launcher_s": secs - (t1 - t0), "seconds": secs}
