"""ChatChoice: one chat choice's generated text -> OpenAI's message (or streamed deltas): reasoning_content apart
from content (--reasoning-parser), then tool calls out of the content, as the request's ToolPlan says
(tool_parsers/tool_plan.py)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from gyrfalcon.server.reasoning import ReasoningParser, ReasoningStreamer
from gyrfalcon.server.tool_parsers import JsonArrayToolParser, ToolCall, ToolCallStreamer, ToolParser
from gyrfalcon.server.tool_parsers.tool_plan import ToolPlan
from gyrfalcon.server.tool_parsers.streaming import call_deltas


class ChatChoice:
    def __init__(self, plan: ToolPlan, reasoning: Optional[ReasoningParser], prompt: str,
                 include_reasoning: bool = True) -> None:
        self.plan = plan
        self.reasoning = reasoning
        self.prompt = prompt
        self.include_reasoning = include_reasoning
        self.called = False
        self._rs = ReasoningStreamer(reasoning, prompt) if reasoning is not None else None
        self._ts = ToolCallStreamer(self._parser()) if plan.mode in ("auto", "required") else None
        self._named: Optional[ToolCall] = None

    def _parser(self) -> ToolParser:
        if self.plan.mode == "required":
            return JsonArrayToolParser(self.plan.tools)
        return self.plan.parser_cls(self.plan.tools)

    def finish_reason(self, reason: Optional[str]) -> Optional[str]:
        return "tool_calls" if self.called and reason == "stop" and self.plan.mode != "named" else reason

    # ---- a whole output ---------------------------------------------------------------------------
    def message(self, text: str) -> Dict[str, Any]:
        reasoning, content = (self.reasoning.split(self.prompt, text) if self.reasoning is not None
                              else (None, text))
        calls: List[ToolCall] = []
        if self.plan.mode == "named":
            calls, content = [ToolCall(self.plan.function, content or "")], None
        elif self.plan.mode in ("auto", "required") and content:
            out = self._parser().extract(content)
            calls, content = out.calls, out.content
            if self.plan.mode == "required" and calls:
                content = None
        if calls and not self.plan.parallel:
            calls = calls[:1]
        self.called = bool(calls)
        msg: Dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning is not None and self.include_reasoning:
            msg["reasoning_content"] = reasoning
        msg["tool_calls"] = [c.to_openai() for c in calls]
        return msg

    # ---- a stream ---------------------------------------------------------------------------------
    def delta(self, text: str, final: bool) -> Dict[str, Any]:
        """The delta for the next piece of text ({} when there is nothing to send yet)."""
        reasoning, content = self._rs.feed(text, final) if self._rs is not None else ("", text)
        items: List[Dict[str, Any]] = []
        if self.plan.mode == "named":
            if self._named is None and (content or final):
                self._named = ToolCall(self.plan.function, "")
                items.append(call_deltas(0, self._named)[0])
                self.called = True
            if content:
                items.append({"index": 0, "function": {"arguments": content}})
            content = ""
        elif self._ts is not None:
            content, items = self._ts.feed(content, final)
            if not self.plan.parallel:
                items = [i for i in items if i["index"] == 0]
            self.called = self._ts.called
        d: Dict[str, Any] = {}
        if reasoning and self.include_reasoning:
            d["reasoning_content"] = reasoning
        if content:
            d["content"] = content
        if items:
            d["tool_calls"] = items
        return d
