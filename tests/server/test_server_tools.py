"""Tool calling and reasoning through a real server (--enable-auto-tool-choice --tool-call-parser hermes
--reasoning-parser qwen3) with a random-weight model: named and required tool calls always parse and validate
against their tool's parameters (whole and streamed); auto tool choice and the reasoning split read outputs
scripted with a regex constraint; tools and chat_template_kwargs reach the chat template."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from server_testutil import API_KEY, MODEL_NAME, ServerProcess

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
ALARM = {"type": "object", "additionalProperties": False, "required": ["hour"],
         "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "set_alarm", "parameters": ALARM}}]
SCHEMAS = {"get_weather": WEATHER, "set_alarm": ALARM}
MSGS = [{"role": "user", "content": "Weather in Paris?"}]
# Thinking off: the template closes the reasoning in the prompt, so output constraints hold from the first token
# (with thinking on they wait for </think>, which a random-weight model never writes).
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
# The test tokenizer's template plus the tool names and Qwen3's enable_thinking switch.
TEMPLATE = ("{% if tools %}{% for t in tools %}[tool {{ t.function.name }}]{% endfor %}\n{% endif %}"
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
            "{% for tc in m.tool_calls or [] %}<call>{{ tc.function.arguments | tojson }}{% endfor %}<|im_end|>\n"
            "{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not "
            "enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def tserver(server_ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("tools")
    (d / "template.jinja").write_text(TEMPLATE)
    srv = ServerProcess(server_ckpt, d / "server.log", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                        "--reasoning-parser", "qwen3", "--chat-template", str(d / "template.jinja"),
                        api_key=API_KEY)
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def _collect_stream(stream):
    """The streamed deltas put together: (content, reasoning, {index: [name, arguments, id]}, finish_reason)."""
    content, reasoning, calls, finish = "", "", {}, None
    for ch in stream:
        if not ch.choices:
            continue
        c = ch.choices[0]
        d = c.delta
        content += d.content or ""
        reasoning += getattr(d, "reasoning_content", None) or ""
        for tc in d.tool_calls or []:
            entry = calls.setdefault(tc.index, ["", "", None])
            if tc.id:
                assert entry[2] is None and tc.type == "function", "one header per call"
                entry[2] = tc.id
            if tc.function and tc.function.name:
                entry[0] = tc.function.name
            if tc.function and tc.function.arguments:
                entry[1] += tc.function.arguments
        finish = c.finish_reason or finish
    return content, reasoning, calls, finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_named_tool_call_always_parses(tserver, stream):
    client = tserver.client()
    choice = {"type": "function", "function": {"name": "set_alarm"}}
    for seed in range(3):
        kw = dict(model=MODEL_NAME, messages=MSGS, tools=TOOLS, tool_choice=choice, max_tokens=200,
                  temperature=1.0, seed=seed, extra_body=NO_THINK)
        if stream:
            _, _, calls, finish = _collect_stream(client.chat.completions.create(stream=True, **kw))
            assert list(calls) == [0] and calls[0][2]
            name, args = calls[0][0], calls[0][1]
        else:
            r = client.chat.completions.create(**kw)
            msg, finish = r.choices[0].message, r.choices[0].finish_reason
            assert len(msg.tool_calls) == 1 and msg.tool_calls[0].type == "function" and msg.tool_calls[0].id
            name, args = msg.tool_calls[0].function.name, msg.tool_calls[0].function.arguments
        assert finish == "stop" and name == "set_alarm"
        jsonschema.validate(json.loads(args), ALARM)
    tserver.wait_idle()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_required_tool_calls_always_parse(tserver, stream):
    client = tserver.client()
    for seed in range(3):
        kw = dict(model=MODEL_NAME, messages=MSGS, tools=TOOLS, tool_choice="required", max_tokens=600,
                  temperature=1.0, seed=seed, extra_body=NO_THINK)
        if stream:
            content, _, calls, finish = _collect_stream(client.chat.completions.create(stream=True, **kw))
            got = [(calls[i][0], calls[i][1]) for i in sorted(calls)]
            assert all(calls[i][2] for i in calls) and not content
        else:
            r = client.chat.completions.create(**kw)
            msg, finish = r.choices[0].message, r.choices[0].finish_reason
            got = [(tc.function.name, tc.function.arguments) for tc in msg.tool_calls]
            assert msg.content is None
        assert finish == "tool_calls" and got
        for name, args in got:
            jsonschema.validate(json.loads(args), SCHEMAS[name])
    r = client.chat.completions.create(model=MODEL_NAME, messages=MSGS, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=600, temperature=1.0, seed=5,
                                       extra_body=NO_THINK)
    assert len(r.choices[0].message.tool_calls) == 1
    tserver.wait_idle()


SCRIPTED_CALL = (r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{2,5}", "days": 3\}\}'
                 r'\n</tool_call>')


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_auto_tool_choice_reads_the_models_calls(tserver, stream):
    """The output is scripted with a regex (the model's weights are random); the hermes parser reads it."""
    client = tserver.client()
    kw = dict(model=MODEL_NAME, messages=MSGS, tools=TOOLS, max_tokens=200, temperature=1.0, seed=1,
              extra_body={"guided_regex": SCRIPTED_CALL, **NO_THINK})
    if stream:
        content, _, calls, finish = _collect_stream(client.chat.completions.create(stream=True, **kw))
        got = [(calls[i][0], json.loads(calls[i][1])) for i in sorted(calls)]
    else:
        r = client.chat.completions.create(**kw)
        msg, finish = r.choices[0].message, r.choices[0].finish_reason
        content = msg.content
        got = [(tc.function.name, json.loads(tc.function.arguments)) for tc in msg.tool_calls]
    assert finish == "tool_calls" and content == "Checking.\n"
    assert len(got) == 1 and got[0][0] == "get_weather" and got[0][1]["days"] == 3
    # Plain text under auto: content, no calls.
    r = client.chat.completions.create(model=MODEL_NAME, messages=MSGS, tools=TOOLS, max_tokens=20, temperature=0,
                                       extra_body={"guided_regex": "[a-z ]{3,12}", **NO_THINK})
    assert r.choices[0].message.tool_calls == [] and r.choices[0].finish_reason == "stop"
    tserver.wait_idle()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_reasoning_is_split_from_content(tserver, stream):
    client = tserver.client()
    kw = dict(model=MODEL_NAME, messages=MSGS, max_tokens=100, temperature=1.0, seed=2,
              extra_body={"guided_regex": r"<think>\n[a-z]{2,6} [a-z]{2,6}\n</think>\n\nAnswer: [a-z]{2,6}",
                          **NO_THINK})
    if stream:
        content, reasoning, _, finish = _collect_stream(client.chat.completions.create(stream=True, **kw))
    else:
        r = client.chat.completions.create(**kw)
        content, reasoning = r.choices[0].message.content, r.choices[0].message.reasoning_content
    whole = f"<think>{reasoning}</think>\n\n{content}"
    assert reasoning.startswith("\n") and reasoning.endswith("\n") and " " in reasoning, whole
    assert content.startswith("Answer: ") and "<" not in content, whole


def test_constraint_waits_for_the_reasoning_to_end(tserver):
    """Thinking on: the reasoning is free and the constraint would start after </think>, which this random model
    never writes; so the output is not held to the choices (with thinking off it is)."""
    client = tserver.client()
    choices = ["yes", "no"]
    kw = dict(model=MODEL_NAME, messages=MSGS, max_tokens=12, temperature=1.0, seed=4)
    off = client.chat.completions.create(**kw, extra_body={"guided_choice": choices, **NO_THINK})
    assert off.choices[0].message.content in choices
    on = client.chat.completions.create(**kw, extra_body={"guided_choice": choices})
    assert on.choices[0].message.content not in choices and on.usage.completion_tokens > 1


def test_tools_and_template_kwargs_reach_the_template(tserver, llm):
    from gyrfalcon.tokenizer import encode

    def prompt_tokens(**extra):
        r = httpx.post(tserver.base_url + "/v1/chat/completions", headers=tserver.headers(), timeout=60,
                       json={"model": MODEL_NAME, "messages": MSGS, "max_tokens": 1, **extra})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    def rendered(**kw):
        text = llm.tokenizer.apply_chat_template(MSGS, tokenize=False, chat_template=TEMPLATE,
                                                 add_generation_prompt=True, **kw)
        return len(encode(llm.tokenizer, text, add_special_tokens=False))

    assert prompt_tokens(tools=TOOLS, tool_choice="none") == rendered(tools=TOOLS)
    # An earlier call's arguments (JSON text on the wire) reach the template as an object, as `tojson` expects.
    turn = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    as_object = [{**turn[0], "content": "", "tool_calls": [{**turn[0]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": {"city": "paris"}}}]}, turn[1]]
    r = httpx.post(tserver.base_url + "/v1/chat/completions", headers=tserver.headers(), timeout=60,
                   json={"model": MODEL_NAME, "messages": MSGS + turn, "max_tokens": 1})
    text = llm.tokenizer.apply_chat_template(MSGS + as_object, tokenize=False, chat_template=TEMPLATE,
                                             add_generation_prompt=True)
    assert r.json()["usage"]["prompt_tokens"] == len(encode(llm.tokenizer, text, add_special_tokens=False))
    assert '"{\\"city' not in text and '{"city": "paris"}' in text
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) == rendered(enable_thinking=False)
    assert rendered(tools=TOOLS) > rendered() and rendered(enable_thinking=False) > rendered()


@pytest.mark.parametrize("body, param, needle", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", "name"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "function"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice", "Only one"),
])
def test_bad_tool_requests_are_400s(tserver, body, param, needle):
    r = httpx.post(tserver.base_url + "/v1/chat/completions", headers=tserver.headers(), timeout=60,
                   json={"model": MODEL_NAME, "messages": MSGS, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err
