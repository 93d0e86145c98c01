"""Bounds before work: a body past --max-request-bytes gets a 413 unread, a text prompt that cannot fit
max_model_len a 400 untokenized, and while such requests are answered the event loop keeps serving /health
and small completions; memory comes back afterwards.

Latency bound: LATENCY_BOUND_S (1 s) for /health and a 1-token completion while 20 MB requests are refused.
On an idle machine they take ~10 ms and ~50 ms; the bound is that generous because CI runs these tests on 2
shared cores next to other test files (a completion's step competes with the engine core, which uses all cores
but one). It catches the failure it is about: tokenizing a 20 MB prompt on the event loop held /health for
~30 s, and a 2 MB one for 1-4 s.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from server_testutil import MODEL_NAME, ServerProcess

LATENCY_BOUND_S = 1.0
BIG = 20_000_000  # characters of the hostile prompts


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def assert_error(r: httpx.Response, status: int, param, *needles: str) -> dict:
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    for n in needles:
        assert n in err["message"], err
    return err


class Prober:
    """Polls /health and a 1-token completion from a thread while the test sends heavy requests; records the
    slowest answer of each."""

    def __init__(self, srv) -> None:
        self.srv = srv
        self.worst = {"health": 0.0, "completion": 0.0}
        self.count = {"health": 0, "completion": 0}
        self.failures = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {"model": MODEL_NAME, "prompt": "def", "max_tokens": 1}
        with httpx.Client(base_url=self.srv.base_url, headers=self.srv.headers(), timeout=60) as c:
            while not self._stop.is_set():
                for name, call in (("health", lambda: c.get("/health")),
                                   ("completion", lambda: c.post("/v1/completions", json=body))):
                    t = time.monotonic()
                    r = call()
                    dt = time.monotonic() - t
                    if r.status_code != 200:
                        self.failures.append((name, r.status_code, r.text[:200]))
                    self.worst[name] = max(self.worst[name], dt)
                    self.count[name] += 1
                time.sleep(0.02)

    def __enter__(self):
        self._thread.start()
        time.sleep(0.3)
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(0.3)
        self._stop.set()
        self._thread.join(60)

    def check(self) -> None:
        assert not self.failures, self.failures[:3]
        assert min(self.count.values()) >= 3, self.count
        assert max(self.worst.values()) < LATENCY_BOUND_S, self.worst


def heavy_requests(srv, n: int = 3):
    """n each of a 20 MB completion, chat and /tokenize, three at a time."""
    text = "hello world " * (BIG // 12)
    bodies = [("/v1/completions", {"model": MODEL_NAME, "prompt": text, "max_tokens": 4}),
              ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": text}]}),
              ("/tokenize", {"model": MODEL_NAME, "prompt": text})]
    payloads = [(path, json.dumps(b).encode()) for path, b in bodies]
    out = []

    def send(path, data):
        with httpx.Client(base_url=srv.base_url, headers={**srv.headers(), "content-type": "application/json"},
                          timeout=120) as c:
            out.append((path, c.post(path, content=data)))

    for _ in range(n):
        threads = [threading.Thread(target=send, args=pd) for pd in payloads]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
    return out


def test_body_over_the_limit_gets_413_unread(server):
    """The shared server has the default limit (16 MiB): 20 MB bodies get a 413 (with a Content-Length, and sent
    chunked without one), and /health and small completions go on answering meanwhile."""
    with Prober(server) as probe:
        answers = heavy_requests(server)
    probe.check()
    assert len(answers) == 9
    for path, r in answers:
        err = assert_error(r, 413, None, "16777216", "--max-request-bytes")
        assert err["code"] == "request_too_large" and err["type"] == "invalid_request_error"

    def chunks():
        for _ in range(20):
            yield b" " * 1_000_000
    r = httpx.post(server.base_url + "/v1/completions", content=chunks(), timeout=60,
                   headers={**server.headers(), "content-type": "application/json"})
    assert_error(r, 413, None, "at least")
    # Under the limit, the same route works (the body reached the app whole).
    r = httpx.post(server.base_url + "/v1/completions", headers=server.headers(), timeout=60,
                   json={"model": MODEL_NAME, "prompt": "ok", "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def big_limit_server(server_ckpt, tmp_path_factory):
    srv = ServerProcess(server_ckpt, tmp_path_factory.mktemp("limits") / "server.log", "--max-request-bytes",
                        str(64 << 20))
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def test_prompt_that_cannot_fit_is_refused_untokenized(big_limit_server):
    """With the body limit raised past them, 20 MB prompts reach the app and are refused by their length in
    characters before any tokenization (tokenizing one takes ~40 s here); the server's memory returns to near
    where it was."""
    srv = big_limit_server
    rss0 = rss_mb(srv.proc.pid)
    t0 = time.monotonic()
    with Prober(srv) as probe:
        answers = heavy_requests(srv)
    elapsed = time.monotonic() - t0
    probe.check()
    assert len(answers) == 9
    params = {"/v1/completions": "prompt", "/v1/chat/completions": "messages", "/tokenize": "prompt"}
    for path, r in answers:
        assert_error(r, 400, params[path], "characters long", "max_model_len=4096")
    assert elapsed < 60, elapsed  # nothing was tokenized (that alone would take minutes)
    # Each request held its body a few times over (~100 MB) while it was parsed; none of that stays.
    time.sleep(0.5)
    grown = rss_mb(srv.proc.pid) - rss0
    assert grown < 200, (rss0, grown)
    print(f"worst /health {probe.worst['health'] * 1e3:.0f} ms, completion {probe.worst['completion'] * 1e3:.0f} "
          f"ms; RSS {rss0:.0f} MB + {grown:.0f} MB")


def test_prompt_under_the_bound_is_tokenized_off_the_loop(big_limit_server, llm):
    """Work that passes every bound still runs off the event loop: 900 prompts of ~5k characters each (~2-3 s of
    tokenization on CI's cores; on the loop it held /health that long), the last one too long for max_tokens, so
    the request ends in a 400 after all of it is tokenized. A prompt just under the character bound is tokenized to
    find it too long; a list of 5M token ids is refused by its length."""
    from gyrfalcon.server.serving import prompt_char_limit

    srv = big_limit_server
    words = "abc def ghi "  # 8 tokens of the test tokenizer
    prompts = [str(i) + words * 400 for i in range(899)] + [words * 450]
    n_last = len(llm.tokenizer(prompts[-1])["input_ids"])
    max_tokens = 4096 - n_last + 1
    assert all(len(llm.tokenizer(p)["input_ids"]) + max_tokens <= 4096 for p in prompts[:-1])
    limit = prompt_char_limit(llm.tokenizer, 4096)  # max_model_len x the longest token, in bytes
    text = (words * limit)[: limit - 10]
    n_tokens = len(llm.tokenizer(text)["input_ids"])
    with Prober(srv) as probe:
        r = httpx.post(srv.base_url + "/v1/completions", timeout=60,
                       json={"model": MODEL_NAME, "prompt": prompts, "max_tokens": max_tokens})
        assert_error(r, 400, "max_tokens", f"{n_last} in the prompt")
        r = httpx.post(srv.base_url + "/v1/completions", timeout=60,
                       json={"model": MODEL_NAME, "prompt": text, "max_tokens": 4})
        assert_error(r, 400, "prompt", f"{n_tokens} tokens long", "max_model_len=4096")
        r = httpx.post(srv.base_url + "/v1/completions", timeout=60,
                       json={"model": MODEL_NAME, "prompt": [7] * 5_000_000, "max_tokens": 4})
        assert_error(r, 400, "prompt", "5000000 tokens long")
    probe.check()
    print(f"worst /health {probe.worst['health'] * 1e3:.0f} ms, completion {probe.worst['completion'] * 1e3:.0f} ms")
