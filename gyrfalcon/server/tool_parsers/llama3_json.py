"""Llama 3.1 / 3.2 / 3.3 JSON calls: the output is one or more JSON objects {"name": ..., "parameters": {...}}
(or "arguments"), separated by ";", optionally after <|python_tag|>. Text that does not start that way is
content."""

from __future__ import annotations

import json
from typing import List, Optional

from gyrfalcon.server.tool_parsers.base import ToolCall, ToolParser, dump_arguments

_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    start_markers = (_TAG,)

    def tool_start(self, text: str) -> Optional[int]:
        stripped = text.lstrip()
        lead = len(text) - len(stripped)
        if stripped.startswith(_TAG) or stripped.startswith("{"):
            return lead
        return None

    def hold_back(self, text: str) -> int:
        # Only the output's start can open a call: hold leading whitespace or a prefix of the tag.
        s = text.lstrip()
        return len(text) if (not s or _TAG.startswith(s)) else 0

    def calls(self, tool_text: str) -> List[ToolCall]:
        s = tool_text.strip()
        if s.startswith(_TAG):
            s = s[len(_TAG):]
        dec = json.JSONDecoder()
        out, i = [], 0
        while True:
            while i < len(s) and s[i] in " \t\r\n;":
                i += 1
            if i >= len(s):
                return out
            try:
                obj, i = dec.raw_decode(s, i)
            except ValueError:
                return out  # an incomplete (or broken) last object
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                out.append(ToolCall(obj["name"], dump_arguments(obj.get("parameters", obj.get("arguments")))))
