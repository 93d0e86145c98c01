"""`gyrfalcon serve --tensor-parallel-size 2` on the CPU: its completions are the offline one-process engine's, and
a SIGKILLed worker turns /health and every request into 503 within seconds (the engine core notices the dead
process while idle, stops the other rank and reports the engine dead), leaving no worker behind."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_testutil import MAX_MODEL_LEN, MODEL_NAME, ServerProcess, child_pids, pid_alive, wait_gone  # noqa: E402

from checkpoints import make_checkpoint  # noqa: E402
from gyrfalcon import LLM, SamplingParams  # noqa: E402

PROMPTS = ["def add(a, b):", "The capital of"]


def _workers(core_pid: int):
    return [p for p in child_pids(core_pid) if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]


def test_server_tp2_matches_one_process_and_reports_a_dead_worker(tmp_path):
    ckpt = make_checkpoint(tmp_path / "qwen3", "qwen3", max_position_embeddings=MAX_MODEL_LEN)
    want = LLM(str(ckpt), max_model_len=MAX_MODEL_LEN, device="cpu").generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    srv = ServerProcess(ckpt, tmp_path / "server.log", "--tensor-parallel-size", "2", "--device", "cpu",
                        "--keep-alive-on-engine-death")
    try:
        workers = _workers(srv.core_pid)
        assert len(workers) == 2, srv.log()[-3000:]
        for prompt, w in zip(PROMPTS, want):
            r = httpx.post(srv.base_url + "/v1/completions", timeout=60, json={
                "model": MODEL_NAME, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == w.outputs[0].text

        os.kill(workers[1], signal.SIGKILL)
        t0 = time.monotonic()
        while httpx.get(srv.base_url + "/health", timeout=5).status_code == 200:
            assert time.monotonic() - t0 < 10, "the server still reports healthy with a dead worker"
            time.sleep(0.1)
        assert httpx.get(srv.base_url + "/health", timeout=5).status_code == 503
        r = httpx.post(srv.base_url + "/v1/completions", timeout=10,
                       json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
        assert "tensor-parallel worker rank 1" in srv.log()
        assert wait_gone(workers[0], 10), "the surviving worker was left running"
        assert srv.stop(signal.SIGTERM) == 0
    finally:
        srv.stop()
        for p in workers if "workers" in locals() else []:
            if pid_alive(p):
                os.kill(p, signal.SIGKILL)
