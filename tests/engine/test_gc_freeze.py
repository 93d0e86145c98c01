"""The engine freezes the cyclic garbage collector's view of startup's objects (gc.freeze) on a GPU, so that a
full collection while serving walks only what requests create; GYRFALCON_GC_FREEZE=1/0 forces it either way.
On the CPU (these tests, many engines in one process) it is off by default: frozen objects that later become
cyclic garbage are never freed."""

from __future__ import annotations

import gc

import pytest

from gyrfalcon import LLM, SamplingParams


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()  # give the objects back to the collector for the rest of the suite


@pytest.mark.parametrize("env, frozen", [(None, False), ("1", True), ("0", False)])
def test_gc_freeze_after_startup(qwen3_ckpt, unfrozen, monkeypatch, env, frozen):
    if env is None:
        monkeypatch.delenv("GYRFALCON_GC_FREEZE", raising=False)
    else:
        monkeypatch.setenv("GYRFALCON_GC_FREEZE", env)
    llm = LLM(str(qwen3_ckpt), max_model_len=64, max_num_seqs=2)
    assert (gc.get_freeze_count() > 0) == frozen
    if frozen:  # the engine and its model are among the frozen objects, not left for the collector
        assert gc.get_freeze_count() >= len(list(llm.engine.runner.model.modules()))
    out = llm.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
