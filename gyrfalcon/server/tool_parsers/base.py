"""ToolParser: a model's own tool-call syntax in generated text -> OpenAI tool calls.

Each family writes its calls its own way (hermes.py, llama3_json.py, deepseek_v3.py, minimax_m2.py, and
json_array.py for tool_choice "required"). A parser says where the tool-call part of a text starts and extracts
the calls that are complete; streaming.py turns that into OpenAI's streamed deltas for any parser.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> Dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ExtractedToolCalls:
    content: Optional[str]  # the text before the tool calls (None when there is none)
    calls: List[ToolCall]


def dump_arguments(args: Any) -> str:
    """Arguments as OpenAI's JSON text (a model may write them as an object or as a string holding one)."""
    if isinstance(args, str):
        try:
            json.loads(args)
            return args
        except ValueError:
            return json.dumps(args, ensure_ascii=False)
    return json.dumps(args if args is not None else {}, ensure_ascii=False)


class ToolParser:
    """start_markers: strings whose first occurrence begins the tool-call part (the text before it is content)."""

    start_markers: Sequence[str] = ()

    def __init__(self, tools: Optional[List[Dict[str, Any]]] = None) -> None:
        self.tools = tools or []

    def tool_start(self, text: str) -> Optional[int]:
        """Where the tool-call part of `text` begins, or None (so far) when it has none."""
        found = [i for i in (text.find(m) for m in self.start_markers) if i >= 0]
        return min(found) if found else None

    def hold_back(self, text: str) -> int:
        """How many characters at the end of `text` (which has no tool-call start yet) could still begin one:
        a stream keeps them until the next delta says."""
        best = 0
        for m in self.start_markers:
            for k in range(min(len(m) - 1, len(text)), best, -1):
                if text.endswith(m[:k]):
                    best = k
                    break
        return best

    def calls(self, tool_text: str) -> List[ToolCall]:
        """The complete calls in the tool-call part (from its start marker on); an incomplete last one is left
        out until it completes."""
        raise NotImplementedError

    def extract(self, text: str) -> ExtractedToolCalls:
        """A whole output: its content and its calls. A text whose tool-call part holds no parseable call is all
        content (as vLLM answers it)."""
        start = self.tool_start(text)
        if start is None:
            return ExtractedToolCalls(text, [])
        calls = self.calls(text[start:])
        if not calls:
            return ExtractedToolCalls(text, [])
        content = text[:start]
        return ExtractedToolCalls(content if content.strip() else None, calls)

    def param_type(self, function: str, param: str) -> Optional[str]:
        """The JSON-schema type the request's tools give `function`'s `param` (None when unknown)."""
        for t in self.tools:
            f = t.get("function") or {}
            if f.get("name") == function:
                prop = ((f.get("parameters") or {}).get("properties") or {}).get(param) or {}
                ty = prop.get("type")
                return ty if isinstance(ty, str) else None
        return None
