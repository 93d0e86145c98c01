"""Structured outputs through a real server with a random-weight model: response_format json_schema /
json_object, vLLM's structured_outputs and guided_* fields hold on every output (streamed too); bad constraints
and unsupported request fields are 400s naming the field; prompt_logprobs and continuous usage stats."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from server_testutil import MODEL_NAME

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "days", "sunny"],
          "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                         "days": {"type": "integer", "minimum": 1, "maximum": 14},
                         "sunny": {"type": "boolean"}}}
MSGS = [{"role": "user", "content": "Weather as JSON"}]


def post(server, path, body):
    return httpx.post(server.base_url + path, json={"model": MODEL_NAME, **body}, headers=server.headers(),
                      timeout=120)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_json_schema_outputs_validate(server, stream):
    client = server.client()
    rf = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
    for seed in range(4):
        kw = dict(model=MODEL_NAME, messages=MSGS, response_format=rf, max_tokens=400, temperature=1.0, seed=seed)
        if stream:
            text, finish = "", None
            for ch in client.chat.completions.create(stream=True, **kw):
                if ch.choices:
                    text += ch.choices[0].delta.content or ""
                    finish = ch.choices[0].finish_reason or finish
        else:
            r = client.chat.completions.create(**kw)
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    server.wait_idle()


def test_vllm_fields_hold(server):
    client = server.client()
    r = client.completions.create(model=MODEL_NAME, prompt="pick:", max_tokens=20, temperature=1.0, seed=1, n=3,
                                  extra_body={"guided_choice": ["red", "green", "blue"]})
    assert {c.text for c in r.choices} <= {"red", "green", "blue"} and all(c.finish_reason == "stop" for c in r.choices)
    r = client.completions.create(model=MODEL_NAME, prompt="id:", max_tokens=20, temperature=1.0, seed=2,
                                  extra_body={"guided_regex": r"[A-Z]{2}\d{3}"})
    assert re.fullmatch(r"[A-Z]{2}\d{3}", r.choices[0].text), r.choices[0].text
    r = client.chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=400, temperature=0,
                                       extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    r = client.chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=400, temperature=0,
                                       extra_body={"structured_outputs": {"json": SCHEMA,
                                                                          "disable_any_whitespace": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    r = client.chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=30, temperature=0,
                                       extra_body={"guided_grammar": 'root ::= "ok" | "no"'})
    assert r.choices[0].message.content in ("ok", "no")
    r = client.chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=300, temperature=0,
                                       response_format={"type": "json_object"},
                                       extra_body={"structured_outputs": None})
    content = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:
        assert content.startswith("{")
    server.wait_idle()


@pytest.mark.parametrize("path, body, param, needle", [
    ("/v1/chat/completions",
     {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "wizard"}}}},
     "response_format", "wizard"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "schema"),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format", "yaml"),
    ("/v1/chat/completions", {"guided_regex": "a(b"}, "guided_regex", "parenthesis"),
    ("/v1/chat/completions", {"guided_grammar": "root ::= nowhere"}, "guided_grammar", "nowhere"),
    ("/v1/chat/completions", {"guided_choice": []}, "guided_choice", "choice"),
    ("/v1/completions", {"guided_json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}},
     "guided_json", "nonsense"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ("/v1/completions", {"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs", "whitespace"),
    ("/v1/completions", {"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "Only one"),
    ("/v1/completions", {"use_beam_search": True}, "use_beam_search", "not supported"),
    ("/v1/completions", {"length_penalty": 0.5}, "length_penalty", "not supported"),
    ("/v1/completions", {"truncate_prompt_tokens": 3}, "truncate_prompt_tokens", "not supported"),
    ("/v1/completions", {"allowed_token_ids": [1, 2]}, "allowed_token_ids", "not supported"),
    ("/v1/completions", {"bad_words": ["x"]}, "bad_words", "not supported"),
    ("/v1/completions", {"logits_processors": ["x"]}, "logits_processors", "not supported"),
    ("/v1/completions", {"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "not supported"),
    ("/v1/completions", {"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids", "not supported"),
    ("/v1/completions", {"detokenize": False}, "detokenize", "not supported"),
    ("/v1/completions", {"best_of": 3}, "best_of", "best_of"),
    ("/v1/completions", {"prompt_logprobs": 99}, "prompt_logprobs", "20"),
    ("/v1/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "stream"),
    ("/v1/chat/completions", {"echo": True}, "echo", "not supported"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions", "not supported"),
    ("/v1/chat/completions", {"continue_final_message": True}, "continue_final_message", "add_generation_prompt"),
    # This server runs without --enable-auto-tool-choice: tools default to "auto", which it cannot serve.
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice",
     "--enable-auto-tool-choice"),
])
def test_bad_constraints_and_unsupported_fields_are_400s(server, path, body, param, needle):
    base = {"messages": MSGS} if "chat" in path else {"prompt": "x"}
    r = post(server, path, {**base, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err


def test_harmless_unsupported_fields_are_accepted(server):
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "priority": 3, "use_beam_search": False,
                                         "guided_decoding_backend": "xgrammar", "length_penalty": 1.0})
    assert r.status_code == 200, r.text
    assert "request field priority is not supported and is ignored" in server.log()


def test_prompt_logprobs_and_continuous_usage(server, llm):
    from gyrfalcon import SamplingParams

    r = post(server, "/v1/completions", {"prompt": "hello world", "max_tokens": 2, "temperature": 0,
                                         "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["prompt_logprobs"]
    want = llm.generate(["hello world"], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1),
                        use_tqdm=False)[0].prompt_logprobs
    assert got[0] is None and len(got) == len(want)
    for g, w in zip(got[1:], want[1:]):
        assert {int(t): v["logprob"] for t, v in g.items()} == pytest.approx({t: e.logprob for t, e in w.items()},
                                                                              abs=1e-4)
    r = post(server, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 2, "prompt_logprobs": 0})
    plp = r.json()["prompt_logprobs"]
    assert plp[0] is None and len(plp) == r.json()["usage"]["prompt_tokens"]
    client = server.client()
    usages = [ch.usage for ch in client.completions.create(
        model=MODEL_NAME, prompt="x", max_tokens=5, temperature=0, stream=True, extra_body={"min_tokens": 5},
        stream_options={"include_usage": True, "continuous_usage_stats": True})]
    assert all(u is not None for u in usages)
    counts = [u.completion_tokens for u in usages]
    assert counts == sorted(counts) and counts[-1] == 5 and usages[-1].prompt_tokens > 0
    server.wait_idle()
