"""MiniMax-M2 calls: <minimax:tool_call> holding one or more
<invoke name="NAME"><parameter name="P">VALUE</parameter>...</invoke>, then </minimax:tool_call>. Values are
text; each becomes the JSON type the request's tool declares for it (numbers, booleans, objects and arrays
parsed; strings kept as written)."""

from __future__ import annotations

import json
import re
from typing import Any, List

from gyrfalcon.server.tool_parsers.base import ToolCall, ToolParser

_INVOKE = re.compile(r'<invoke\s+name="([^"]*)"\s*>(.*?)</invoke>', re.DOTALL)
_PARAM = re.compile(r'<parameter\s+name="([^"]*)"\s*>(.*?)</parameter>', re.DOTALL)


class MiniMaxM2ToolParser(ToolParser):
    start_markers = ("<minimax:tool_call>",)

    def _value(self, function: str, param: str, raw: str) -> Any:
        text = raw.strip("\n")
        ty = self.param_type(function, param)
        if ty == "string":
            return text
        try:
            return json.loads(text)
        except ValueError:
            return text

    def calls(self, tool_text: str) -> List[ToolCall]:
        out = []
        for name, body in _INVOKE.findall(tool_text):
            args = {p: self._value(name, p, v) for p, v in _PARAM.findall(body)}
            out.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        return out
