"""Process lifecycle: a killed engine core fails the requests in flight and turns the server to 503 without
hanging, then the server exits with code 1 (or, with --keep-alive-on-engine-death, stays up answering 503);
SIGINT / SIGTERM stop the server and its engine core cleanly; a killed server takes its engine core with it."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from server_testutil import MODEL_NAME, ServerProcess, pid_alive, wait_gone


@pytest.fixture
def fresh_server(server_ckpt, tmp_path):
    servers = []

    def start(*args, **kwargs):
        srv = ServerProcess(server_ckpt, tmp_path / f"server{len(servers)}.log", *args, **kwargs)
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.stop()


def ipc_dirs(srv):
    return [d for d in os.listdir(srv.tmpdir) if d.startswith("gyrfalcon-")]


def _long_stream(srv, headers, lines, started):
    """A stream of 3000 tokens, read line by line into `lines`; a cut connection just ends it."""
    body = {"model": MODEL_NAME, "prompt": "def", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, headers=headers, timeout=30) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    if len(lines) == 3:
                        started.set()
    except httpx.HTTPError as e:
        lines.append(f"<{type(e).__name__}>")


def test_engine_core_death_keep_alive(fresh_server):
    """GYRFALCON_API_KEY works like --api-key; then the engine core is SIGKILLed mid-generation, and with
    --keep-alive-on-engine-death the server stays up answering 503."""
    srv = fresh_server("--keep-alive-on-engine-death", env={"GYRFALCON_API_KEY": "env-key"})
    h = {"Authorization": "Bearer env-key"}
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2}
    assert httpx.post(srv.base_url + "/v1/completions", json=body).status_code == 401
    assert httpx.post(srv.base_url + "/v1/completions", json=body, headers=h).status_code == 200

    lines, started = [], threading.Event()
    streamer = threading.Thread(target=_long_stream, args=(srv, h, lines, started))
    streamer.start()
    blocking = {}

    def blocking_request():
        b = {"model": MODEL_NAME, "prompt": "y", "max_tokens": 3000, "ignore_eos": True}
        blocking["r"] = httpx.post(srv.base_url + "/v1/completions", json=b, headers=h, timeout=30)

    waiter = threading.Thread(target=blocking_request)
    waiter.start()
    assert started.wait(30)
    time.sleep(0.2)
    t0 = time.monotonic()
    os.kill(srv.core_pid, signal.SIGKILL)
    streamer.join(15)
    waiter.join(15)
    assert not streamer.is_alive() and not waiter.is_alive(), "a request hung after the engine died"
    assert time.monotonic() - t0 < 10
    # The stream ends with an error event, then [DONE].
    assert lines[-1] == "data: [DONE]"
    err = json.loads(lines[-2][len("data: "):])["error"]
    assert "engine" in err["message"].lower()
    assert blocking["r"].status_code == 503 and "engine" in blocking["r"].json()["error"]["message"]

    r = httpx.get(srv.base_url + "/health", timeout=5)
    assert r.status_code == 503
    for path, b in (("/v1/completions", body),
                    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}]})):
        t = time.monotonic()
        for stream in (False, True):
            r = httpx.post(srv.base_url + path, json={**b, "stream": stream}, headers=h, timeout=10)
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "engine_dead"
        assert time.monotonic() - t < 3
    assert "exited with code" in srv.log()
    assert "Traceback" not in srv.log(), srv.log()[-3000:]  # expected failures are not crashes
    time.sleep(3)  # past the grace period after which a server without the flag exits
    assert srv.proc.poll() is None and httpx.get(srv.base_url + "/health", timeout=5).status_code == 503
    # Still shuts down cleanly.
    assert srv.stop(signal.SIGTERM) == 0


def test_engine_core_death_exits(fresh_server):
    """By default a dead engine core ends the server: the request in flight gets its error, and the server
    exits with code 1 shortly after (a supervisor then restarts it), taking nothing else down with it."""
    srv = fresh_server()
    lines, started = [], threading.Event()
    streamer = threading.Thread(target=_long_stream, args=(srv, {}, lines, started))
    streamer.start()
    assert started.wait(30)
    t0 = time.monotonic()
    os.kill(srv.core_pid, signal.SIGKILL)
    streamer.join(15)
    assert not streamer.is_alive()
    assert lines[-1] == "data: [DONE]" and "engine" in json.loads(lines[-2][len("data: "):])["error"]["message"]
    assert srv.proc.wait(30) == 1, srv.log()[-3000:]
    assert time.monotonic() - t0 < 20
    log = srv.log()
    assert "--keep-alive-on-engine-death" in log and "Exiting with code 1" in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    assert not ipc_dirs(srv), "the server left its IPC directory behind"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_shuts_down_cleanly(fresh_server, sig):
    """With a stream in flight: after --shutdown-timeout the stream ends with an error event and
    [DONE], the server and its engine core exit 0, and nothing is left behind."""
    srv = fresh_server("--shutdown-timeout", "1")
    lines, started = [], threading.Event()
    streamer = threading.Thread(target=_long_stream, args=(srv, {}, lines, started), daemon=True)
    streamer.start()
    assert started.wait(30)
    core = srv.core_pid
    t0 = time.monotonic()
    srv.proc.send_signal(sig)
    assert srv.proc.wait(20) == 0, srv.log()[-3000:]
    assert wait_gone(core, 10), ("the engine core outlived the server", srv.log()[-3000:])
    assert time.monotonic() - t0 < 10
    streamer.join(10)
    assert lines[-1] == "data: [DONE]", lines[-3:]
    assert json.loads(lines[-2][len("data: "):]).get("error", {}).get("code") == "server_shutting_down", lines[-3:]
    assert "Shutting down the engine core" in srv.log()
    assert not ipc_dirs(srv), "the server left its IPC directory behind"


def test_killed_server_takes_engine_core_along(fresh_server, tmp_path):
    """(This server also checks --chat-template FILE, to save a server start.)"""
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}[assistant] {% endif %}")
    srv = fresh_server("--chat-template", str(template))
    msgs = [{"role": "user", "content": "hello"}]
    toks = httpx.post(srv.base_url + "/tokenize", json={"messages": msgs}).json()["tokens"]
    text = httpx.post(srv.base_url + "/detokenize", json={"tokens": toks}).json()["prompt"]
    assert text == "[user] hello\n[assistant] ", text
    r = httpx.post(srv.base_url + "/v1/chat/completions", json={"model": MODEL_NAME, "messages": msgs,
                                                                "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(toks), r.text

    core = srv.core_pid
    assert pid_alive(core)
    srv.proc.kill()
    srv.proc.wait(10)
    assert wait_gone(core, 10), ("orphaned engine core", srv.log()[-3000:])
