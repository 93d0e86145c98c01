"""Helpers for the server tests: a real `gyrfalcon serve` process on 127.0.0.1, /proc process checks,
and the offline LLM as the oracle.

Every server is started on a free port and stopped by its fixture's finalizer (SIGTERM, then SIGKILL,
and its engine core too if it is somehow still there), so no test leaves a process behind. Each server gets
its own TMPDIR, where it makes the directory of its IPC sockets: a server that stopped cleanly has removed
it (`ipc_dirs_left` says), and one killed on purpose leaves it there for stop() to remove, not in /tmp.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import httpx

REPO = Path(__file__).resolve().parents[2]
API_KEY = "test-key-123"
MODEL_NAME = "tiny-qwen3"
MAX_MODEL_LEN = 4096


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(pid: int) -> List[int]:
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name may hold spaces and parentheses: the ppid follows the last ')'.
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(d))
    return out


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return not pid_alive(pid)


class ServerProcess:
    def __init__(self, ckpt: Path, log_path: Path, *args: str, env: Optional[Dict[str, str]] = None,
                 api_key: Optional[str] = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log_path
        e = dict(os.environ)
        e["PYTHONPATH"] = str(REPO) + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
        e.setdefault("GYRFALCON_LOG_STATS_INTERVAL", "2")
        e.pop("TRITON_INTERPRET", None)  # the tests' CPU-kernel setting; a server runs as a user's would
        # Short (an ipc:// path must fit in 107 bytes), private, and removed by stop().
        self.tmpdir = tempfile.mkdtemp(prefix="gyrt-")
        self.ipc_dirs_left: List[str] = []
        e["TMPDIR"] = self.tmpdir
        e.update(env or {})
        cmd = [sys.executable, "-m", "gyrfalcon.cli", "serve", str(ckpt), "--port", str(self.port),
               "--served-model-name", MODEL_NAME, "--max-model-len", str(MAX_MODEL_LEN),
               "--disable-uvicorn-access-log", *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=e, cwd=str(REPO))
        self.core_pid: Optional[int] = None
        try:
            self._wait_ready(240)
        except BaseException:
            self.stop()
            raise

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def headers(self) -> Dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    cores = [p for p in child_pids(self.proc.pid) if b"core_process" in
                             Path(f"/proc/{p}/cmdline").read_bytes()]
                    assert len(cores) == 1, cores
                    self.core_pid = cores[0]
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"the server did not become healthy in {timeout} s:\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> Optional[int]:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.core_pid is not None and pid_alive(self.core_pid) and not wait_gone(self.core_pid, 5):
            os.kill(self.core_pid, signal.SIGKILL)  # only if shutdown failed; the test then fails
            wait_gone(self.core_pid, 5)
        self._log.close()
        if os.path.isdir(self.tmpdir):
            self.ipc_dirs_left = [d for d in os.listdir(self.tmpdir) if d.startswith("gyrfalcon-")]
            shutil.rmtree(self.tmpdir, ignore_errors=True)
        return self.proc.returncode

    def client(self):
        import openai
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=self.api_key or "none", max_retries=0,
                             timeout=120)

    def async_client(self):
        import openai
        return openai.AsyncOpenAI(base_url=self.base_url + "/v1", api_key=self.api_key or "none", max_retries=0,
                                  timeout=120)

    def metrics(self) -> Dict[str, float]:
        """/metrics parsed with prometheus-client's parser: {'name{label=value,...}': value}."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.base_url + "/metrics", timeout=10).text
        out: Dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return out

    def wait_idle(self, timeout: float = 15.0) -> Dict[str, float]:
        """Poll /metrics until no request runs or waits and the KV cache is back to empty."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (m["gyrfalcon:num_requests_running"] == 0 and m["gyrfalcon:num_requests_waiting"] == 0
                    and m["gyrfalcon:kv_cache_usage_perc"] == 0.0):
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"the server did not go idle: {m}")
            time.sleep(0.1)


class Oracle:
    """The offline LLM, run on one torch thread (on a 2-core machine shared with a server, two
    threads make it several times slower) and restoring the thread count afterwards."""

    def __init__(self, llm) -> None:
        self.llm = llm
        self.tokenizer = llm.tokenizer

    def _one_thread(self, fn, *args, **kwargs):
        import torch
        n = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(n)

    def generate(self, *args, **kwargs):
        return self._one_thread(self.llm.generate, *args, **kwargs)

    def chat(self, *args, **kwargs):
        return self._one_thread(self.llm.chat, *args, **kwargs)
