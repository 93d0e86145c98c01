"""engine_args.ENGINE_ARGS is the one declaration of the engine's settings: every config field has exactly one,
and the CLI flags, LLM() keywords and EngineConfig.create keywords all come from it and reach the config."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json

import pytest

from gyrfalcon import config as C
from gyrfalcon import engine_args as E

CONFIG_CLASSES = {"": C.EngineConfig, "model_config": C.ModelConfig, "cache_config": C.CacheConfig,
                  "scheduler_config": C.SchedulerConfig, "parallel_config": C.ParallelConfig,
                  "speculative_config": C.SpeculativeConfig}


def test_every_config_field_has_exactly_one_declaration():
    sub = {f.name for f in dataclasses.fields(C.EngineConfig) if f.name.endswith("_config")}
    assert sub == set(CONFIG_CLASSES) - {""}, "a new sub-config: add it to CONFIG_CLASSES and declare its fields"
    paths = [a.path for a in E.ENGINE_ARGS]
    whole = {a.path for a in E.ENGINE_ARGS if a.whole}  # a sub-config given as one dict: its keys are its fields
    want = set(whole)
    for owner, cls in CONFIG_CLASSES.items():
        if owner in whole:
            continue
        for f in dataclasses.fields(cls):
            if f.init and not (owner == "" and f.name in sub):
                want.add(f"{owner}.{f.name}" if owner else f.name)
    dup = sorted(p for p in paths if paths.count(p) > 1)
    assert not dup, f"declared twice: {dup}"
    assert set(paths) == want, (f"fields without a declaration: {sorted(want - set(paths))}; "
                                f"declarations without a field: {sorted(set(paths) - want)}")
    names = [a.name for a in E.ENGINE_ARGS]
    assert len(names) == len(set(names))


def _sample(a: E.EngineArg):
    """A value other than the default, as (command-line words, the config's value)."""
    if a.whole:  # speculative_config: a JSON object
        return [a.flag, '{"method": "ngram", "num_speculative_tokens": 2}'], C.SpeculativeConfig(
            method="ngram", num_speculative_tokens=2)
    if a.kind == E.SWITCH:
        return [a.flag], True
    if a.kind == E.ON_OFF:
        return ([f"--no-{a.flag[2:]}"], False) if a.default is not False else ([a.flag], True)
    if a.kind == E.LIST:
        return [a.flag, "x", "y"], ["x", "y"]
    if a.choices:
        v = next(c for c in a.choices if c != a.default)
        return [a.flag, v], v
    if a.type is int:
        return [a.flag, "7"], 7
    if a.type is float:
        return [a.flag, "0.5"], 0.5
    return [a.flag, "some-value"], "some-value"


def _get(cfg, path):
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


def test_each_flag_reaches_its_config_field():
    """One flag at a time, a non-default value: parsed, turned into keywords, built into an EngineConfig, it
    lands in the declared field and leaves every other field at its default."""
    p = argparse.ArgumentParser()
    E.add_engine_args(p)
    base = E.build_config("m", E.engine_kwargs(p.parse_args([])))
    public = [a for a in E.ENGINE_ARGS if a.scope == E.PUBLIC and a.name != "model"]
    assert len(public) >= 20
    for a in public:
        argv, value = _sample(a)
        cfg = E.build_config("m", E.engine_kwargs(p.parse_args(argv)))
        assert _get(cfg, a.path) == value, a.name
        assert _get(base, a.path) == (CONFIG_CLASSES[a.path]() if a.whole else a.default), a.name
        for b in public:
            if b is not a:
                assert _get(cfg, b.path) == _get(base, b.path), (a.name, b.name)
    for a in public:
        for alias in a.aliases:
            argv, value = _sample(a)
            assert _get(E.build_config("m", E.engine_kwargs(p.parse_args([alias, *argv[1:]]))), a.path) == value


def test_llm_keywords_are_the_public_declarations():
    from gyrfalcon import LLM

    sig = inspect.signature(LLM)
    names = [n for n in sig.parameters if n != "model"]
    assert names == [n for n in E.PUBLIC_NAMES if n != "model"]
    assert all(sig.parameters[n].default == E.BY_NAME[n].default for n in names)
    with pytest.raises(TypeError, match="offline"):  # internal: set by LLM itself
        LLM("x", offline=False)
    with pytest.raises(TypeError, match="bogus"):
        C.EngineConfig.create("x", bogus=1)


def test_model_positional_or_flag():
    from gyrfalcon.cli import build_parser
    from gyrfalcon.engine_args import resolve_model_arg

    for argv in (["serve", "m"], ["serve", "--model", "m"], ["serve", "m", "--model", "m"]):
        args = build_parser().parse_args(argv)
        resolve_model_arg(args)
        assert args.model == "m", argv
    args = build_parser().parse_args(["serve", "a", "--model", "b"])
    with pytest.raises(ValueError, match="two models"):
        resolve_model_arg(args)


def test_generation_config_source(tmp_path, qwen3_ckpt):
    """auto: the model's generation_config.json; vllm: none of its sampling fields; a folder: that folder's. The
    end-of-sequence ids stay the model's."""
    import shutil

    d = tmp_path / "m"
    shutil.copytree(qwen3_ckpt, d)
    gen = json.loads((d / "generation_config.json").read_text())
    eos = gen["eos_token_id"]
    (d / "generation_config.json").write_text(json.dumps({**gen, "temperature": 0.3, "top_k": 5}))
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.9, "eos_token_id": 12345}))

    def gen_of(**kw):
        return C.EngineConfig.create(str(d), device="cpu", **kw).model_config.generation_config

    assert gen_of()["temperature"] == 0.3 and gen_of(generation_config="auto")["top_k"] == 5
    assert gen_of(generation_config="vllm") == {"eos_token_id": eos}
    assert gen_of(generation_config=str(other)) == {"temperature": 0.9, "eos_token_id": eos}
    with pytest.raises(FileNotFoundError, match="generation_config.json"):
        gen_of(generation_config=str(tmp_path / "nowhere"))
