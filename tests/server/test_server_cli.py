"""A vLLM launch script's command line against gyrfalcon: `serve --model X` with vLLM's server flags (several API
keys, CORS, --root-path, request logging, --metrics-prefix vllm) starts, and each flag does what it does in vLLM;
a vLLM flag gyrfalcon lacks stops the launch with a message that says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_testutil import MODEL_NAME, REPO, ServerProcess

KEYS = ("key-one", "key-two", "key-three")
ORIGIN = "http://dash.example"
ROOT = "/gf"
SECRET_TAIL = "and-the-rest-of-this-prompt-stays-out-of-the-log"

# vLLM's metric names and types that --metrics-prefix vllm serves.
VLLM_METRICS = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge", "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter", "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter", "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram", "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram", "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram", "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram", "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram", "vllm:iteration_tokens_total": "histogram",
}


@pytest.fixture(scope="module")
def vllm_server(server_ckpt, tmp_path_factory):
    # ServerProcess puts its checkpoint argument right after `serve`; given as "--model=DIR" it is the flag form.
    srv = ServerProcess(Path(f"--model={server_ckpt}"), tmp_path_factory.mktemp("logs") / "vllm-style.log",
                        "--api-key", KEYS[0], KEYS[1], "--api-key", KEYS[2], "--metrics-prefix", "vllm",
                        "--allowed-origins", json.dumps([ORIGIN]), "--allow-credentials", "--root-path", ROOT,
                        "--enable-log-requests", "--max-log-len", "10", "--trust-remote-code",
                        "--generation-config", "auto", "--no-enable-prefix-caching")
    srv.api_key = KEYS[1]
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def _metrics(srv):
    text = httpx.get(srv.base_url + "/metrics", timeout=10).text
    fams = list(text_string_to_metric_families(text))
    values = {}
    for f in fams:
        for s in f.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "le"))
            if "le" not in s.labels:
                values[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return {f.name: f for f in fams}, values


def _wait_idle(srv):
    deadline = time.monotonic() + 15
    while True:
        _, m = _metrics(srv)
        if m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.1)


def test_vllm_metric_names_and_the_new_histograms(vllm_server):
    fams, _ = _metrics(vllm_server)
    for name, kind in VLLM_METRICS.items():
        assert name in fams, name
        assert fams[name].type == kind, (name, fams[name].type)
        assert all(s.labels.get("model_name") == MODEL_NAME for s in fams[name].samples), name
    assert not [n for n in fams if n.startswith("gyrfalcon:")]

    before = _wait_idle(vllm_server)
    c = vllm_server.client()
    jobs = [("def f(x):", 5, False), ("hello world, again", 3, True), ("x = 1", 1, False), ("for i in", 4, True)]
    prompt = completion = 0
    for text, max_tokens, stream in jobs:
        r = c.completions.create(model=MODEL_NAME, prompt=text, max_tokens=max_tokens, stream=stream,
                                 stream_options={"include_usage": True} if stream else None,
                                 extra_body={"ignore_eos": True})
        usage = [ch for ch in r][-1].usage if stream else r.usage
        prompt += usage.prompt_tokens
        completion += usage.completion_tokens
    after = _wait_idle(vllm_server)

    def delta(key):
        return after[key] - before.get(key, 0.0)

    n = len(jobs)
    assert delta("vllm:prompt_tokens_total") == prompt and delta("vllm:generation_tokens_total") == completion
    assert delta("vllm:request_success_total{finished_reason=length}") == n
    for h in ("request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
              "request_prompt_tokens", "request_generation_tokens", "time_to_first_token_seconds",
              "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert delta(f"vllm:{h}_count") == n, h
    assert delta("vllm:request_prompt_tokens_sum") == prompt
    assert delta("vllm:request_generation_tokens_sum") == completion
    # One inter-token gap per token after the first (one token per step without speculative decoding); the older
    # name repeats it.
    assert delta("vllm:inter_token_latency_seconds_count") == completion - n
    assert delta("vllm:time_per_output_token_seconds_count") == completion - n
    assert delta("vllm:request_time_per_output_token_seconds_count") == sum(1 for j in jobs if j[1] > 1)
    # Every step's tokens: each prompt once (no prefix cache) and every generated token but the last one fed back.
    assert delta("vllm:iteration_tokens_total_sum") == prompt + completion - n
    assert 1 <= delta("vllm:iteration_tokens_total_count") <= prompt + completion
    assert delta("vllm:request_inference_time_seconds_sum") >= delta("vllm:request_decode_time_seconds_sum")


def test_each_api_key_works_and_others_are_refused(vllm_server):
    url = vllm_server.base_url + "/v1/models"
    for key in KEYS:
        assert httpx.get(url, headers={"Authorization": f"Bearer {key}"}).status_code == 200, key
    for bad in ({"Authorization": "Bearer key-four"}, {"Authorization": f"Bearer {KEYS[0][:-1]}"}, {}):
        r = httpx.get(url, headers=bad)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", bad


def test_root_path(vllm_server):
    """Behind a proxy that keeps the prefix, or one that strips it: both reach the routes; the public paths stay
    public under the prefix; the OpenAPI schema names the prefix."""
    auth = vllm_server.headers()
    for path in (f"{ROOT}/v1/models", "/v1/models"):
        r = httpx.get(vllm_server.base_url + path, headers=auth)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL_NAME, path
    assert httpx.get(vllm_server.base_url + f"{ROOT}/health").status_code == 200
    assert httpx.get(vllm_server.base_url + f"{ROOT}/v1/models").status_code == 401
    schema = httpx.get(vllm_server.base_url + f"{ROOT}/openapi.json", headers=auth).json()
    assert {"url": ROOT} in schema.get("servers", [])


def test_cors_preflight_and_headers(vllm_server):
    url = vllm_server.base_url + "/v1/chat/completions"
    pre = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(url, headers=pre)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert r.headers["access-control-allow-credentials"] == "true"
    assert "POST" in r.headers["access-control-allow-methods"]
    bad = httpx.options(url, headers={**pre, "Origin": "http://evil.example"})
    assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
    # A real request from the allowed origin carries the header, a refused one (no key) too.
    r = httpx.get(vllm_server.base_url + "/v1/models", headers={"Origin": ORIGIN, **vllm_server.headers()})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.get(vllm_server.base_url + "/v1/models", headers={"Origin": ORIGIN})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN


def test_requests_are_logged_cut_to_max_log_len(vllm_server):
    vllm_server.client().completions.create(model=MODEL_NAME, prompt="log-me-" + SECRET_TAIL, max_tokens=2,
                                            extra_body={"ignore_eos": True})
    deadline = time.monotonic() + 10
    while "Received request /v1/completions" not in vllm_server.log():
        assert time.monotonic() < deadline, vllm_server.log()[-2000:]
        time.sleep(0.1)
    lines = [ln for ln in vllm_server.log().splitlines() if "Received request /v1/completions" in ln]
    assert any("prompt: 'log-me-and'..." in ln and "'max_tokens': 2" in ln for ln in lines), lines
    assert SECRET_TAIL not in vllm_server.log()


def _cli(*args):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "gyrfalcon.cli", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def test_unknown_vllm_flag_is_named(server_ckpt):
    """Refused by the parser, before any model loads: a vLLM flag gyrfalcon lacks is named as such (value and
    `=value` forms), an unknown flag of no one's gets argparse's message."""
    p = _cli("serve", "--model", str(server_ckpt), "--swap-space", "4", "--disable-log-requests", "--max-log-len",
             "10")
    assert p.returncode == 2
    assert "--swap-space is a vLLM flag that gyrfalcon does not support" in p.stderr, p.stderr
    p = _cli("serve", str(server_ckpt), "--cpu-offload-gb=2", "--tokenizer-mode", "slow")
    assert p.returncode == 2
    assert "--cpu-offload-gb, --tokenizer-mode are vLLM flags that gyrfalcon does not support" in p.stderr
    p = _cli("serve", str(server_ckpt), "--no-such-flag-anywhere")
    assert p.returncode == 2 and "unrecognized arguments: --no-such-flag-anywhere" in p.stderr
    assert "vLLM" not in p.stderr
    p = _cli("generate", "--model", str(server_ckpt), "--swap-space", "4")
    assert p.returncode == 2 and "--swap-space is a vLLM flag" in p.stderr
    p = _cli("bench", "serve", "--sonnet-input-len", "550", "--swap-space", "4")
    assert p.returncode == 2
    assert "--sonnet-input-len is a vllm bench serve flag that gyrfalcon does not support" in p.stderr, p.stderr
    assert "`gyrfalcon bench serve --help`" in p.stderr


def test_vllm_style_flags_parse():
    from gyrfalcon.cli import build_parser

    args = build_parser().parse_args(["serve", "--model", "m", "--disable-log-requests", "--max-log-len", "10",
                                      "--api-key", "a", "--allowed-origins", "http://a.com,http://b.com",
                                      "--allowed-methods", '["GET", "POST"]'])
    assert args.disable_log_requests and args.max_log_len == 10 and args.api_key == ["a"]
    assert args.allowed_origins == ["http://a.com", "http://b.com"] and args.allowed_methods == ["GET", "POST"]
    assert args.allowed_headers == ["*"] and not args.allow_credentials and args.metrics_prefix == "gyrfalcon"


def test_config_file(tmp_path, server_ckpt):
    """`serve --config FILE` (vLLM's YAML of flags): its keys with '-' or '_', switches, off-switches and lists;
    the command line wins; a vLLM key gyrfalcon lacks is named like the flag."""
    from gyrfalcon.cli import build_parser
    from gyrfalcon.engine_args import resolve_model_arg
    from gyrfalcon.server.cli import expand_config_file

    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"model: {server_ckpt}\nmax-num-seqs: 7\nmax_model_len: 512\nenable-prefix-caching: false\n"
                   "api-key: [k1, k2]\nallow-credentials: true\nport: 9001\nroot_path: /x\n")
    argv = expand_config_file(["serve", "--config", str(cfg), "--port", "9002"])
    args = build_parser().parse_args(argv)
    resolve_model_arg(args)
    assert args.model == str(server_ckpt) and args.max_num_seqs == 7 and args.max_model_len == 512
    assert args.enable_prefix_caching is False and args.api_key == ["k1", "k2"] and args.allow_credentials
    assert args.port == 9002 and args.root_path == "/x"
    assert expand_config_file(["serve", "m"]) == ["serve", "m"]
    (tmp_path / "bad.yaml").write_text("swap_space: 4\n")
    p = _cli("serve", "--config", str(tmp_path / "bad.yaml"))
    assert p.returncode == 2 and "--swap-space is a vLLM flag that gyrfalcon does not support" in p.stderr, p.stderr
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    p = _cli("serve", "--config=" + str(tmp_path / "list.yaml"))
    assert p.returncode == 2 and "expected a mapping" in p.stderr, p.stderr
