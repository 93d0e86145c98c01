"""runner/precompile.py's plumbing on the CPU (the compiles themselves need a GPU):
the warm-up runs it makes are the ones capture_ladder makes, and inside them every Triton launch becomes a
compile-only warmup in an AsyncCompileMode, undone afterwards."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.runtime.jit import JITFunction  # noqa: E402

from gyrfalcon.forward_context import get_forward_context  # noqa: E402
from gyrfalcon.kernels import common as _common  # noqa: E402
from gyrfalcon.runner.precompile import ladder_warmup_steps, precompile  # noqa: E402


def _prepare(calls):
    def prepare(size):
        fb = SimpleNamespace(size=size, input_ids=torch.zeros(size, dtype=torch.int64))

        def step():
            ctx = get_forward_context()
            calls.append((size, ctx.batch.size, _common._PDL_WARMUP[0], _common._PDL_OFF[0]))
        return fb, step
    return prepare


@pytest.mark.parametrize("batch1_pdl,want_b1", [(None, [(1, 1, True, False)]), (False, [(1, 1, True, True)]),
                                                (True, [(1, 1, True, False)])])
def test_ladder_warmup_steps_match_the_capture(batch1_pdl, want_b1):
    """Largest size first, each under its own forward context and pdl_warmup; batch 1 with PDL off where the
    ladder captures it so (on a CPU PDL is impossible, so auto mode captures batch 1 once)."""
    calls = []
    steps = ladder_warmup_steps([1, 2, 8], [], _prepare(calls), batch1_pdl)
    assert calls == []  # nothing runs until the steps are called
    for s in steps:
        s()
    assert calls == [(8, 8, True, False), (2, 2, True, False)] + want_b1
    assert not _common._PDL_WARMUP[0] and not _common._PDL_OFF[0]  # restored


def test_precompile_turns_launches_into_async_warmups(monkeypatch):
    seen = []

    def fake_run(self, *args, grid, warmup, **kwargs):
        from triton.runtime._async_compile import active_mode
        seen.append((args, grid, warmup, kwargs, active_mode.get() is not None))
        return "kernel"
    monkeypatch.setattr(JITFunction, "run", fake_run)
    kernel = object.__new__(JITFunction)  # (only its class's run is used)

    def step():
        assert JITFunction.run(kernel, 1, 2, grid=(4,), warmup=False, num_warps=4) == "kernel"
    stats = precompile([step, step], workers=2)
    assert stats["steps"] == 2 and stats["launchers"] == 0 and stats["seconds"] >= stats["compile_s"] >= 0
    assert seen == [((1, 2), (4,), True, {"num_warps": 4}, True)] * 2
    assert JITFunction.run is fake_run  # compile_only undone


def test_precompile_builds_the_new_kernels_launchers_in_its_threads(monkeypatch):
    """Each kernel compiled inside the AsyncCompileMode gets its launcher built in a pool thread (Triton 3.6
    builds a C extension there, at the first launch otherwise); a kernel that has its launcher is left alone."""
    import threading

    class Kernel:
        def __init__(self, name, has_launcher=False):
            self.src, self.metadata, self._run = name, {"name": name}, (object() if has_launcher else None)

    def fake_run(self, *args, grid, warmup, **kwargs):
        import inspect

        from triton.runtime._async_compile import active_mode
        name = args[0]
        mode = active_mode.get()
        # (key, compile_fn, finalize_fn) in Triton 3.6; newer ones add a cleanup_fn
        extra = [lambda *a: None] * (len(inspect.signature(mode.submit).parameters) - 3)
        return mode.submit(name, lambda: Kernel(name, has_launcher=name == "loaded"), lambda k: None, *extra)
    monkeypatch.setattr(JITFunction, "run", fake_run)
    kernel = object.__new__(JITFunction)
    built = []

    def launcher_cls(src, metadata):
        assert metadata == {"name": src}
        built.append((src, threading.current_thread() is not threading.main_thread()))

    def step():
        for name in ("a", "b", "a", "loaded"):  # "a" twice: one compile, one launcher
            JITFunction.run(kernel, name, grid=(1,), warmup=False)
    stats = precompile([step], workers=2, launcher_cls=launcher_cls)
    assert sorted(built) == [("a", True), ("b", True)]
    assert stats["kernels"] == 3 and stats["launchers"] == 2
