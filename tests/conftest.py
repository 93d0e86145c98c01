import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# Tests must be reproducible and fast on 2 cores; transformers must not reach for a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without a GPU, Triton kernels run in the interpreter. This must be set before anything imports
# triton, and the root conftest loads before any test module.
if not os.path.exists("/dev/nvidia0") and not os.environ.get("CUDA_VISIBLE_DEVICES"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # And one intra-op thread per process: scripts/test.sh runs one pytest-xdist worker per core, the tiny models'
    # ops gain nothing from more threads, and two workers' OpenMP pools of nproc threads each, spinning on the same
    # cores, made sampling-heavy tests 10-20x slower (tests/spec_decode/test_sampled.py: 138 s a case, 7 s with
    # one thread). Set before torch loads; the servers and ranks the tests spawn inherit it. An explicit value wins.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch  # noqa: E402

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # in case a plugin imported torch before this file

from checkpoints import make_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def qwen3_ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")


@pytest.fixture(scope="session")
def llama_ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="session", params=["qwen3", "llama"])
def tiny_ckpt(request, qwen3_ckpt, llama_ckpt) -> Path:
    return qwen3_ckpt if request.param == "qwen3" else llama_ckpt


@pytest.fixture(autouse=True)
def _fresh_envs():
    """gyrfalcon.envs caches the environment on first read: a test that sets a variable (monkeypatch) sees it,
    and the next test does not inherit it."""
    from gyrfalcon import envs
    envs.refresh()
    yield
    envs.refresh()
