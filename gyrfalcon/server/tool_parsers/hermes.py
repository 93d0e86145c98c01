"""Hermes-style calls (Qwen2.5 / Qwen3, NousResearch Hermes): each call is a JSON object
{"name": ..., "arguments": {...}} between <tool_call> and </tool_call>, after any text."""

from __future__ import annotations

import json
import re
from typing import List

from gyrfalcon.server.tool_parsers.base import ToolCall, ToolParser, dump_arguments

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class HermesToolParser(ToolParser):
    start_markers = ("<tool_call>",)

    def calls(self, tool_text: str) -> List[ToolCall]:
        out = []
        for body in _CALL.findall(tool_text):
            try:
                obj = json.loads(body)
            except ValueError:
                continue
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                out.append(ToolCall(obj["name"], dump_arguments(obj.get("arguments", obj.get("parameters")))))
        return out
