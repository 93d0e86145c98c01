"""Hugging Face hub ids (`gyrfalcon serve org/name`, `LLM("org/name")`) resolved through huggingface_hub against a
cache folder that the test lays out as the hub cache does (models--org--name/refs/<ref> holding a commit id,
snapshots/<commit>/<files>), offline (HF_HUB_OFFLINE=1, set for every test by conftest.py): these machines
have no hub access."""

from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoints import make_checkpoint
from gyrfalcon import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
MAIN, V2 = "a" * 40, "b" * 40


def _add_snapshot(cache: Path, repo: str, commit: str, ref: str, src: Path) -> Path:
    folder = cache / f"models--{repo.replace('/', '--')}"
    snap = folder / "snapshots" / commit
    shutil.copytree(src, snap)
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, qwen3_ckpt):
    """org/tiny at main: the tiny Qwen3 checkpoint; at ref v2: a tiny Llama one."""
    cache = tmp_path_factory.mktemp("hub")
    llama = make_checkpoint(tmp_path_factory.mktemp("llama"), "llama")
    _add_snapshot(cache, "org/tiny", MAIN, "main", qwen3_ckpt)
    _add_snapshot(cache, "org/tiny", V2, "v2", llama)
    return cache


def test_offline_hub_id_resolves_to_the_cached_snapshot(hub_cache, qwen3_ckpt):
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    llm = LLM("org/tiny", download_dir=str(hub_cache), block_size=8)
    mc = llm.config.model_config
    assert Path(mc.model) == hub_cache / "models--org--tiny" / "snapshots" / MAIN
    assert mc.served_model_name == "org/tiny"  # the id it was given, as vLLM serves it
    assert mc.hf_config.architectures == ["Qwen3ForCausalLM"]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = llm.generate(["def add(a, b):"], sp, use_tqdm=False)[0].outputs[0].token_ids
    want = LLM(str(qwen3_ckpt), block_size=8).generate(["def add(a, b):"], sp, use_tqdm=False)[0].outputs[0]
    assert got == want.token_ids


def test_revision_picks_the_ref(hub_cache):
    from gyrfalcon.config import EngineConfig

    cfg = EngineConfig.create("org/tiny", download_dir=str(hub_cache), revision="v2", device="cpu")
    assert Path(cfg.model_config.model).name == V2
    assert cfg.model_config.hf_config.architectures == ["LlamaForCausalLM"]


def test_missing_repo_or_revision_is_a_clear_error(hub_cache):
    with pytest.raises(FileNotFoundError, match=r"'org/absent' is not a local path.*no snapshot.*in the cache"):
        LLM("org/absent", download_dir=str(hub_cache))
    with pytest.raises(FileNotFoundError, match=r"at revision 'v9'"):
        LLM("org/tiny", download_dir=str(hub_cache), revision="v9")


def test_local_paths_win_and_are_not_hub_ids(tmp_path, monkeypatch, qwen3_ckpt):
    """A path that exists locally is used as it is, even when it looks like org/name; one that does not and is
    not org/name-shaped gets the local error, not a hub lookup."""
    import huggingface_hub

    calls = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: calls.append((a, k)))
    (tmp_path / "org").mkdir()
    shutil.copytree(qwen3_ckpt, tmp_path / "org" / "tiny")
    monkeypatch.chdir(tmp_path)
    from gyrfalcon.config import EngineConfig

    assert EngineConfig.create("org/tiny", device="cpu").model_config.model == "org/tiny"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        EngineConfig.create("./missing/dir/x", device="cpu")
    assert calls == []


def test_download_asks_only_for_config_tokenizer_and_safetensors(monkeypatch, qwen3_ckpt):
    """What a download fetches (snapshot_download's allow_patterns): configs, tokenizer files and the chat
    template, safetensors; not the .bin / .pth / .gguf copies that repositories also carry."""
    import huggingface_hub

    seen = {}

    def fake(repo_id, revision=None, cache_dir=None, allow_patterns=None, **kw):
        seen.update(repo_id=repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=allow_patterns)
        return str(qwen3_ckpt)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    from gyrfalcon.config import EngineConfig

    cfg = EngineConfig.create("org/other", revision="r1", download_dir="/tmp/dl", device="cpu")
    assert cfg.model_config.model == str(qwen3_ckpt)
    assert (seen["repo_id"], seen["revision"], seen["cache_dir"]) == ("org/other", "r1", "/tmp/dl")

    def fetched(name):
        return any(fnmatch.fnmatch(name, p) for p in seen["allow_patterns"])

    for name in ("config.json", "generation_config.json", "model.safetensors", "model-00001-of-00002.safetensors",
                 "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                 "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt"):
        assert fetched(name), name
    for name in ("pytorch_model.bin", "consolidated.safetensors.pth", "original/consolidated.00.pth",
                 "model.gguf", "onnx/model.onnx", "README.md"):
        assert not fetched(name), name


def test_cli_reads_the_hub_cache_from_the_environment(hub_cache):
    """`gyrfalcon generate --model org/tiny` with HF_HUB_CACHE pointing at the cache and HF_HUB_OFFLINE=1."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}
    p = subprocess.run([sys.executable, "-m", "gyrfalcon.cli", "generate", "--model", "org/tiny", "--prompt", "x",
                        "--max-tokens", "4", "--ignore-eos", "--device", "cpu"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "finish_reason=length tokens=4" in p.stderr
