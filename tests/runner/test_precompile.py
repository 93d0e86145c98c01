"""runner/precompile.py's plumbing on the CPU (the compiles themselves need a GPU: gpu_check.sh coldstart):
the warm-up runs it makes are the ones capture_ladder makes, and inside them every Triton launch becomes a
compile-only warmup in an AsyncCompileMode, undone afterwards."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.runtime.jit import JITFunction  # noqa: E402

from gyrfalcon.forward_context import get_forward_context  # noqa: E402
from gyrfalcon.kernels import _common  # noqa: E402
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
    secs = precompile([step, step], workers=2)
    assert secs >= 0
    assert seen == [((1, 2), (4,), True, {"num_warps": 4}, True)] * 2
    assert JITFunction.run is fake_run  # compile_only undone
