"""Bad requests get OpenAI's error body with the right status, and never a crash or a hang."""

from __future__ import annotations

import httpx
import openai
import pytest

from server_testutil import MAX_MODEL_LEN, MODEL_NAME


def post(server, path, body, headers=None, **kw):
    return httpx.post(server.base_url + path, json=body, headers=server.headers() if headers is None else headers,
                      timeout=30, **kw)


def assert_error(r: httpx.Response, status: int, *needles: str):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for n in needles:
        assert n in err["message"], err
    return err


def test_prompt_longer_than_context(server):
    ids = [5] * (MAX_MODEL_LEN + 100)
    r = post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": ids, "max_tokens": 4})
    assert_error(r, 400, str(MAX_MODEL_LEN + 100), str(MAX_MODEL_LEN))
    # Prompt plus max_tokens past the context: both numbers too.
    r = post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": [5] * 4000, "max_tokens": 200})
    assert_error(r, 400, "4000", "200", str(MAX_MODEL_LEN))
    r = post(server, "/v1/chat/completions", {"model": MODEL_NAME, "max_tokens": 4,
                                              "messages": [{"role": "user", "content": "a " * 5000}]})
    assert_error(r, 400, str(MAX_MODEL_LEN))
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(model=MODEL_NAME, prompt=ids, max_tokens=4)
    assert str(MAX_MODEL_LEN) in str(e.value)


@pytest.mark.parametrize("body, needle", [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 2}, "top_p"),
    ({"prompt": "x", "min_p": 1.5}, "min_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 4, "min_tokens": 8}, "min_tokens"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream"),
    ({"prompt": "x", "n": 129}, "128"),
    ({"prompt": "x", "logprobs": 21}, "20"),
    ({"prompt": ""}, "empty"),
    ({"prompt": []}, "prompt"),
    ({"prompt": 17}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [99999]}, "99999"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "x", "seed": 2 ** 70}, "seed"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "[-100, 100]"),
    ({"prompt": "x", "logit_bias": {"99999999": 1}}, "99999999"),
    ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
])
def test_invalid_completion_params(server, body, needle):
    r = post(server, "/v1/completions", {"model": MODEL_NAME, **body})
    assert_error(r, 400, needle)


@pytest.mark.parametrize("body, needle", [
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "no role"}]}, "role"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "20"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 1000}, "128"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "text"),
    ({"messages": "hello"}, "messages"),
])
def test_invalid_chat_params(server, body, needle):
    r = post(server, "/v1/chat/completions", {"model": MODEL_NAME, **body})
    assert_error(r, 400, needle)


def test_malformed_json(server):
    r = httpx.post(server.base_url + "/v1/completions", content=b"{not json",
                   headers={**server.headers(), "content-type": "application/json"})
    assert_error(r, 400)


def test_api_key(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "test-key-123"}):
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
            r = post(server, path, {"model": MODEL_NAME, "prompt": "x"}, headers=headers)
            assert_error(r, 401, "API key")
        r = httpx.get(server.base_url + "/v1/models", headers=headers)
        assert r.status_code == 401
    # Probes and scrapers need no key.
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(server.base_url + path).status_code == 200
    bad = openai.OpenAI(base_url=server.base_url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2)


def test_unknown_model(server):
    for path, body in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        err = assert_error(post(server, path, {"model": "gpt-17", **body}), 404, "gpt-17")
        assert err["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="gpt-17", prompt="x", max_tokens=2)


def test_unknown_route(server):
    r = httpx.get(server.base_url + "/v1/nothing", headers=server.headers())
    assert_error(r, 404)


def test_server_still_serves_after_errors(server):
    r = server.client().completions.create(model=MODEL_NAME, prompt="ok", max_tokens=3)
    assert r.choices[0].finish_reason in ("length", "stop")
    server.wait_idle()
