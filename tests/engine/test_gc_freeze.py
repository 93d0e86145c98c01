"""freeze_gc_after_startup (engine.py) takes startup's objects out of the cyclic garbage collector's sight
(gc.freeze), so that a full collection while serving walks only what requests create. The server's engine core
does it by default; the offline LLM only with GYRFALCON_GC_FREEZE=1 (a process may build and drop several
LLMs, and frozen objects caught in reference cycles are never freed); GYRFALCON_GC_FREEZE=0 turns it off
everywhere."""

from __future__ import annotations

import gc

import pytest

from gyrfalcon import LLM, SamplingParams, envs
from gyrfalcon.engine.engine import freeze_gc_after_startup


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()  # give the objects back to the collector for the rest of the suite


@pytest.mark.parametrize("env, default, frozen", [(None, True, True), (None, False, False), ("0", True, False),
                                                  ("1", False, True)])
def test_freeze_gc_after_startup(unfrozen, monkeypatch, env, default, frozen):
    if env is None:
        monkeypatch.delenv("GYRFALCON_GC_FREEZE", raising=False)
    else:
        monkeypatch.setenv("GYRFALCON_GC_FREEZE", env)
    envs.refresh()
    keep = [{"a": [i]} for i in range(100)]  # tracked containers alive now
    assert freeze_gc_after_startup(default) == frozen
    assert (gc.get_freeze_count() >= len(keep)) == frozen


@pytest.mark.parametrize("env, frozen", [(None, False), ("1", True), ("0", False)])
def test_offline_llm_freezes_only_when_asked(qwen3_ckpt, unfrozen, monkeypatch, env, frozen):
    if env is None:
        monkeypatch.delenv("GYRFALCON_GC_FREEZE", raising=False)
    else:
        monkeypatch.setenv("GYRFALCON_GC_FREEZE", env)
    envs.refresh()
    llm = LLM(str(qwen3_ckpt), max_model_len=64, max_num_seqs=2)
    assert (gc.get_freeze_count() > 0) == frozen
    if frozen:  # the engine and its model are among the frozen objects, not left for the collector
        assert gc.get_freeze_count() >= len(list(llm.engine.runner.model.modules()))
    out = llm.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
