"""Every 400 names its parameter: the checks added for hostile input (unknown roles, top_k below -1, seeds past
64 bits, null content, NaN / Infinity, long stop lists, wrong item types) and the existing ones' `param`."""

from __future__ import annotations

import httpx
import pytest

from server_testutil import MODEL_NAME

MSG = [{"role": "user", "content": "x"}]


def post(server, path, body=None, content=None):
    headers = {**server.headers(), "content-type": "application/json"}
    return httpx.post(server.base_url + path, json=body, content=content, headers=headers, timeout=30)


@pytest.mark.parametrize("path, body, param, needle", [
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages", "'wizard'"),
    ("/v1/chat/completions", {"messages": [{"role": 5, "content": "x"}]}, "messages", "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages", "content"),
    ("/v1/chat/completions", {"messages": [{"role": "system"}]}, "messages", "content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
     "messages", "text"),
    ("/v1/chat/completions", {"messages": "hello"}, "messages", "list"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "messages", "role"),
    ("/v1/chat/completions", {"messages": []}, "messages", "empty"),
    ("/v1/chat/completions", {"messages": MSG, "top_k": -5}, "top_k", "-5"),
    ("/v1/chat/completions", {"messages": MSG, "seed": 2 ** 80}, "seed", "64-bit"),
    ("/v1/chat/completions", {"messages": MSG, "max_completion_tokens": 0}, "max_completion_tokens", "at least 1"),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 5000}, "max_tokens", "5000"),
    ("/v1/chat/completions", {"messages": MSG, "max_completion_tokens": 5000}, "max_completion_tokens", "5000"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a " * 5000}]}, "messages", "4096"),
    ("/v1/completions", {"prompt": "x", "top_k": -2}, "top_k", "-2"),
    ("/v1/completions", {"prompt": "x", "temperature": 0, "top_k": -5}, "top_k", "-5"),  # greedy checks too
    ("/v1/completions", {"prompt": "x", "temperature": 0, "top_p": 2}, "top_p", "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": 2 ** 40}, "top_k", str(2 ** 40)),
    ("/v1/completions", {"prompt": "x", "seed": 2 ** 80}, "seed", "64-bit"),
    ("/v1/completions", {"prompt": "x", "seed": -2 ** 64}, "seed", "64-bit"),
    ("/v1/completions", {"prompt": "x", "n": 2, "seed": 2 ** 63 - 1}, "seed", "2**63 - 2"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature", "non-negative"),
    ("/v1/completions", {"prompt": "x", "top_p": 2}, "top_p", "top_p"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 20}, "min_tokens", "max_tokens"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", "positive"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop", "empty"),
    ("/v1/completions", {"prompt": "x", "stop": ["a"] * 257}, "stop", "256"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [2 ** 70]}, "stop_token_ids", "token ids"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids", "token ids"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [1] * 257}, "stop_token_ids", "256"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ("/v1/completions", {"prompt": "x", "logit_bias": [1, 2]}, "logit_bias", "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999999": 1}}, "logit_bias", "99999999"),
    ("/v1/completions", {"prompt": [1, "a"]}, "prompt", "prompt"),
    ("/v1/completions", {"prompt": [1, True]}, "prompt", "integers"),
    ("/v1/completions", {"prompt": [[1], "a"]}, "prompt", "prompt"),
    ("/v1/completions", {"prompt": [[]]}, "prompt", "empty"),
    ("/v1/completions", {"prompt": {"a": 1}}, "prompt", "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt", "empty"),
    ("/v1/completions", {"prompt": [99999]}, "prompt", "99999"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, "max_tokens", "5000"),
    ("/v1/completions", {"prompt": "x", "n": 200}, "n", "128"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs", "20"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens", "max_tokens"),
    ("/tokenize", {"prompt": 5}, "prompt", "string"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages", "wizard"),
    ("/tokenize", {}, "prompt", "exactly one"),
    ("/detokenize", {"tokens": ["a"]}, "tokens", "token ids"),
    ("/detokenize", {"tokens": [10 ** 9]}, "tokens", "out of range"),
])
def test_bad_values_name_their_parameter(server, path, body, param, needle):
    r = post(server, path, {"model": MODEL_NAME, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert needle in err["message"], err


@pytest.mark.parametrize("field, literal", [("temperature", "NaN"), ("top_p", "NaN"), ("min_p", "NaN"),
                                            ("presence_penalty", "NaN"), ("repetition_penalty", "Infinity"),
                                            ("temperature", "-Infinity")])
def test_non_finite_numbers(server, field, literal):
    """Python's JSON parser accepts NaN and Infinity; NaN passed every range check before."""
    r = post(server, "/v1/completions", content=f'{{"model": "{MODEL_NAME}", "prompt": "x", "{field}": {literal}}}')
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and "finite" in err["message"], err


def test_null_content_allowed_for_assistant(server, llm):
    """OpenAI accepts an assistant turn without content (one that called a tool); it renders as empty text."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}, {"role": "user", "content": "x"}]
    r = post(server, "/v1/chat/completions", {"model": MODEL_NAME, "messages": msgs, "max_tokens": 2})
    assert r.status_code == 200, r.text
    from gyrfalcon.tokenizer import encode, render_chat

    text = render_chat(llm.tokenizer, [{**m, "content": m["content"] or ""} for m in msgs])
    assert r.json()["usage"]["prompt_tokens"] == len(encode(llm.tokenizer, text, add_special_tokens=False))
    server.wait_idle()
