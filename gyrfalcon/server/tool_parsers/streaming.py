"""ToolCallStreamer: one choice's streamed text -> content deltas and OpenAI tool-call deltas, for any ToolParser.

Content streams until the parser's tool-call start shows up (a tail that could still become one is held back
until the next delta). From there the text is buffered, and each call is sent once it is complete: a delta with
its index, id, type, name and empty arguments, then one with the arguments (OpenAI's chunk shape: clients
concatenate argument fragments per index). At the end, a tool-call part that held no call is sent as content,
as the non-streamed answer has it.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from gyrfalcon.server.tool_parsers.base import ToolCall, ToolParser


def call_deltas(index: int, call: ToolCall) -> List[Dict[str, Any]]:
    """A complete call as two tool_calls delta items: the header, then its arguments."""
    return [{"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}},
            {"index": index, "function": {"arguments": call.arguments}}]


class ToolCallStreamer:
    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of text sent as content
        self.tool_start = None  # where the tool-call part begins, once seen
        self.calls: List[ToolCall] = []

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def feed(self, delta: str, final: bool = False) -> Tuple[str, List[Dict[str, Any]]]:
        """(content delta, tool_calls delta items) for the next piece of text; final: the last piece."""
        self.text += delta
        if self.tool_start is None:
            self.tool_start = self.parser.tool_start(self.text)
        if self.tool_start is None:
            end = len(self.text) if final else len(self.text) - self.parser.hold_back(self.text)
            content, self.sent = self.text[self.sent:end], max(self.sent, end)
            return content, []
        content = self.text[self.sent:self.tool_start]
        self.sent = max(self.sent, self.tool_start)
        items: List[Dict[str, Any]] = []
        calls = self.parser.calls(self.text[self.tool_start:])
        for i in range(len(self.calls), len(calls)):
            self.calls.append(calls[i])
            items += call_deltas(i, calls[i])
        if final and not self.calls:
            content += self.text[self.sent:]  # nothing parsed: the answer was text after all
            self.sent = len(self.text)
        return content, items
