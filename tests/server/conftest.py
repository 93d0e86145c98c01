"""Fixtures for the server tests: the shared server, the checkpoint it serves, and the offline oracle.

Every server is started on a free port and stopped by its fixture's finalizer (see server_testutil.py),
so no test leaves a process behind.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from server_testutil import API_KEY, MAX_MODEL_LEN, Oracle, ServerProcess


def pytest_addoption(parser):
    # Known when this folder's tests are named on the command line (pytest tests/server/test_server_soak.py
    # --soak-requests 2000); elsewhere the test reads its default.
    parser.addoption("--soak-requests", type=int, default=300, help="requests test_server_soak.py sends")


@pytest.fixture(scope="session")
def server_ckpt(tmp_path_factory, qwen3_ckpt) -> Path:
    """The session's tiny qwen3 checkpoint with a 4096-token context (the rope does not depend on it),
    so a request can ask for thousands of tokens."""
    dst = tmp_path_factory.mktemp("server-ckpt") / "qwen3-4k"
    shutil.copytree(qwen3_ckpt, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["max_position_embeddings"] = MAX_MODEL_LEN
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="session")
def llm(server_ckpt):
    """The offline engine with the server's settings: the oracle for every output."""
    from gyrfalcon import LLM
    return Oracle(LLM(str(server_ckpt), max_model_len=MAX_MODEL_LEN))


@pytest.fixture(scope="session")
def server(server_ckpt, tmp_path_factory):
    """The shared server (API key required) that most tests talk to."""
    srv = ServerProcess(server_ckpt, tmp_path_factory.mktemp("logs") / "server.log", api_key=API_KEY)
    yield srv
    rc = srv.stop()
    assert rc == 0, srv.log()[-3000:]
    assert not srv.ipc_dirs_left, "a cleanly stopped server left its IPC directory behind"
