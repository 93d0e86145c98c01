"""DeepSeek-V3 / R1 calls, between <｜tool▁calls▁begin｜> and <｜tool▁calls▁end｜>, each
<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>. DeepSeek-V3.1 and
V3.2 drop the type and the fence: <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>; both are read."""

from __future__ import annotations

import json
import re
from typing import List

from gyrfalcon.server.tool_parsers.base import ToolCall, ToolParser, dump_arguments

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
SEP = "<｜tool▁sep｜>"
CALL_END = "<｜tool▁call▁end｜>"

_CALL = re.compile(re.escape(CALL_BEGIN) + r"(.*?)" + re.escape(SEP) + r"(.*?)" + re.escape(CALL_END), re.DOTALL)
_FENCED = re.compile(r"^\s*([^\n]*?)\s*\n\s*```(?:json)?\s*(.*?)\s*```\s*$", re.DOTALL)


class DeepSeekV3ToolParser(ToolParser):
    start_markers = (CALLS_BEGIN, CALL_BEGIN)

    def calls(self, tool_text: str) -> List[ToolCall]:
        out = []
        for head, body in _CALL.findall(tool_text):
            fenced = _FENCED.match(body)
            if fenced:  # V3: head is the type ("function"), the name opens the body, then the fenced JSON
                name, args = fenced.group(1), fenced.group(2)
            else:  # V3.1: head is the name
                name, args = head, body
            name = name.strip()
            try:
                obj = json.loads(args)
            except ValueError:
                continue
            if name:
                out.append(ToolCall(name, dump_arguments(obj)))
        return out
