"""tool_choice "required": the output is constrained (structured outputs) to a JSON array of
{"name": ..., "parameters": {...}}, one item per call, so every call parses."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

from gyrfalcon.server.tool_parsers.base import ToolCall, ToolParser, dump_arguments


def required_calls_schema(tools: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The JSON schema of that array: each item names one of the tools and carries its parameters."""
    items = []
    for t in tools:
        f = t["function"]
        params = f.get("parameters") or {"type": "object", "properties": {}}
        items.append({"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                      "properties": {"name": {"const": f["name"]}, "parameters": params}})
    return {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}


class JsonArrayToolParser(ToolParser):
    def tool_start(self, text: str) -> Optional[int]:
        return 0

    def hold_back(self, text: str) -> int:
        return len(text)

    def calls(self, tool_text: str) -> List[ToolCall]:
        s = tool_text.lstrip()
        if not s.startswith("["):
            return []
        dec = json.JSONDecoder()
        out, i = [], 1
        while True:
            while i < len(s) and s[i] in " \t\r\n,":
                i += 1
            if i >= len(s) or s[i] == "]":
                return out
            try:
                obj, i = dec.raw_decode(s, i)
            except ValueError:
                return out  # the item being written
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                out.append(ToolCall(obj["name"], dump_arguments(obj.get("parameters"))))
