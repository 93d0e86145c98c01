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
        kw["num_gpu_blocks"] = kw.pop("num_gpu_blocks_override")  # LLM's name for it
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
    kw["num_gpu_blocks"] = kw.pop("num_gpu_blocks_override")
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
