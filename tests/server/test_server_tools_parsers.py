"""The tool-call parsers on scripted model outputs (each family's own syntax), whole and streamed in every split:
the streamed content and calls must be the whole output's."""

from __future__ import annotations

import json
import random

import pytest

from gyrfalcon.server.tool_parsers import TOOL_PARSERS, JsonArrayToolParser, ToolCallStreamer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "zip": {"type": "string"}, "metric": {"type": "boolean"}}}}}]

WEATHER = {"city": "Paris", "days": 3}
TIME = {"tz": "UTC"}

CASES = {
    "hermes": ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>',
               "Let me check.\n"),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
                    '{"name": "get_time", "parameters": {"tz": "UTC"}}', None),
    "deepseek_v3": ("Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                    '{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>'
                    'get_time\n```json\n{"tz": "UTC"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "Sure."),
    "deepseek_v31": ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "days": 3}'
                     '<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"tz": "UTC"}<｜tool▁call▁end｜>'
                     "<｜tool▁calls▁end｜>", None),
    "minimax_m2": ('Checking.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris'
                   '</parameter>\n<parameter name="days">3</parameter>\n</invoke>\n<invoke name="get_time">\n'
                   '<parameter name="tz">UTC</parameter>\n</invoke>\n</minimax:tool_call>', "Checking.\n"),
}


def _streamed(parser, text, rng):
    s = ToolCallStreamer(parser)
    content, items = "", []
    i = 0
    while i < len(text):
        j = min(len(text), i + rng.randint(1, 7))
        c, it = s.feed(text[i:j], final=(j == len(text)))
        content += c
        items += it
        i = j
    calls = {}
    for it in items:
        d = calls.setdefault(it["index"], {"name": "", "arguments": ""})
        if "id" in it:
            assert it["type"] == "function" and it["id"].startswith("call_")
            d["name"] = it["function"]["name"]
        d["arguments"] += it["function"]["arguments"]
    return content, [calls[k] for k in sorted(calls)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_parser_extracts_calls_whole_and_streamed(name):
    text, content = CASES[name]
    parser = TOOL_PARSERS[name](TOOLS)
    out = parser.extract(text)
    assert out.content == content
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [("get_weather", WEATHER), ("get_time", TIME)]
    rng = random.Random(0)
    for _ in range(20):
        got_content, got_calls = _streamed(parser, text, rng)
        assert got_content == (content or "")
        assert [(c["name"], json.loads(c["arguments"])) for c in got_calls] == \
            [("get_weather", WEATHER), ("get_time", TIME)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_plain_text_is_content(name):
    parser = TOOL_PARSERS[name](TOOLS)
    text = "The weather in Paris is mild; no tool needed < 3 > 1."
    out = parser.extract(text)
    assert out.content == text and out.calls == []
    rng = random.Random(1)
    assert _streamed(parser, text, rng) == (text, [])


def test_broken_call_is_content():
    text = "<tool_call>\n{not json}\n</tool_call>"
    out = TOOL_PARSERS["hermes"](TOOLS).extract(text)
    assert out.content == text and not out.calls
    assert _streamed(TOOL_PARSERS["hermes"](TOOLS), text, random.Random(2)) == (text, [])


def test_minimax_values_follow_the_declared_types():
    text = ('<minimax:tool_call><invoke name="get_weather"><parameter name="zip">02139</parameter>'
            '<parameter name="days">4</parameter><parameter name="metric">true</parameter>'
            '<parameter name="other">[1, 2]</parameter></invoke></minimax:tool_call>')
    call = TOOL_PARSERS["minimax_m2"](TOOLS).extract(text).calls[0]
    assert json.loads(call.arguments) == {"zip": "02139", "days": 4, "metric": True, "other": [1, 2]}


def test_json_array_for_required_streams_items_as_they_complete():
    p = JsonArrayToolParser(TOOLS)
    s = ToolCallStreamer(p)
    text = '[{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}, {"name": "get_time", "parameters": {}}]'
    cut = text.index(", {") + 1
    c1, first = s.feed(text[:cut])
    assert c1 == "" and [i["function"].get("name") for i in first if "id" in i] == ["get_weather"]
    c2, second = s.feed(text[cut:], final=True)
    assert c2 == "" and [i["function"].get("name") for i in second if "id" in i] == ["get_time"]
