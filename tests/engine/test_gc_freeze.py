"""freeze_gc_after_startup (engine.py) takes startup's objects out of the cyclic garbage collector's sight
(gc.freeze), so that a full collection while serving walks only what requests create. The server's engine core
does it by default; the offline LLM only with GYRFALCON_GC_FREEZE=1 (a process may build and drop several
LLMs, and frozen objects caught in reference cycles are never freed); each generate call freezes for its own length
and gives everything back after (gc_frozen_while_running); GYRFALCON_GC_FREEZE=0 turns both off everywhere."""

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


def _gc_env(monkeypatch, env) -> None:
    """GYRFALCON_GC_FREEZE set to env (None: unset), read again."""
    if env is None:
        monkeypatch.delenv("GYRFALCON_GC_FREEZE", raising=False)
    else:
        monkeypatch.setenv("GYRFALCON_GC_FREEZE", env)
    envs.refresh()


@pytest.mark.parametrize("env, default, frozen", [(None, True, True), (None, False, False), ("0", True, False),
                                                  ("1", False, True)])
def test_freeze_gc_after_startup(unfrozen, monkeypatch, env, default, frozen):
    _gc_env(monkeypatch, env)
    keep = [{"a": [i]} for i in range(100)]  # tracked containers alive now
    assert freeze_gc_after_startup(default) == frozen
    assert (gc.get_freeze_count() >= len(keep)) == frozen


@pytest.mark.parametrize("env, frozen", [(None, False), ("1", True), ("0", False)])
def test_offline_llm_freezes_only_when_asked(qwen3_ckpt, unfrozen, monkeypatch, env, frozen):
    _gc_env(monkeypatch, env)
    llm = LLM(str(qwen3_ckpt), max_model_len=64, max_num_seqs=2)
    assert (gc.get_freeze_count() > 0) == frozen
    if frozen:  # the engine and its model are among the frozen objects, not left for the collector
        assert gc.get_freeze_count() >= len(list(llm.engine.runner.model.modules()))
    out = llm.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("env, during", [(None, True), ("0", False)])
def test_generate_freezes_only_for_its_run(qwen3_ckpt, unfrozen, monkeypatch, env, during):
    """LLM.generate's loop runs with what was alive at its start frozen (engine.gc_frozen_while_running: the step's
    collections then walk only what the run creates), and gives it back after, so a dropped LLM is still freed;
    GYRFALCON_GC_FREEZE=0 turns it off."""
    _gc_env(monkeypatch, env)
    llm = LLM(str(qwen3_ckpt), max_model_len=64, max_num_seqs=2)
    assert gc.get_freeze_count() == 0
    seen = []
    step = llm.engine.step
    llm.engine.step = lambda: seen.append(gc.get_freeze_count()) or step()
    out = llm.generate(["def f(x):", "x ="], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]
    assert seen and all((n >= len(list(llm.engine.runner.model.modules()))) == during for n in seen)
    assert gc.get_freeze_count() == 0


def test_a_startup_freeze_is_left_alone(qwen3_ckpt, unfrozen, monkeypatch):
    """With GYRFALCON_GC_FREEZE=1 the offline LLM froze its startup objects: a run neither adds to that freeze nor
    undoes it."""
    _gc_env(monkeypatch, "1")
    llm = LLM(str(qwen3_ckpt), max_model_len=64, max_num_seqs=2)
    frozen = gc.get_freeze_count()
    assert frozen > 0
    llm.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    # (frozen objects whose last reference went away during the run left the count)
    assert frozen - 100 < gc.get_freeze_count() <= frozen
