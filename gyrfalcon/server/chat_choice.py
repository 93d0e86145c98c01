"""ChatChoice: one chat choice's generated text -> OpenAI's message (or streamed deltas): reasoning_content apart
from content (--reasoning-parser), then tool calls out of the content (ToolPlan: tool_choice and the parser).

ToolPlan.from_request checks `tools` / `tool_choice` and decides how calls are produced:
- "none" (or no tools): plain text; tools still go to the chat template, as vLLM does;
- "auto": the model writes calls in its own syntax; --tool-call-parser reads them (needs
  --enable-auto-tool-choice);
- "required": the output is constrained to a JSON array of {"name", "parameters"} items over the tools (structured
  outputs), so it always parses, into one call per item;
- a named function: the output is constrained to that function's parameters schema and is its arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Type

from gyrfalcon.sampling_params import StructuredOutputsParams
from gyrfalcon.server.protocol import bad_request
from gyrfalcon.server.reasoning import ReasoningParser, ReasoningStreamer
from gyrfalcon.server.tool_parsers import (JsonArrayToolParser, ToolCall, ToolCallStreamer, ToolParser,
                                           required_calls_schema)
from gyrfalcon.server.tool_parsers.streaming import call_deltas


@dataclass
class ToolPlan:
    mode: str = "none"  # none | auto | required | named
    tools: List[Dict[str, Any]] = field(default_factory=list)
    parser_cls: Optional[Type[ToolParser]] = None
    function: Optional[str] = None  # the named function
    parallel: bool = True

    @classmethod
    def from_request(cls, tools: Any, tool_choice: Any, parallel: Optional[bool],
                     parser_cls: Optional[Type[ToolParser]], auto_enabled: bool) -> "ToolPlan":
        checked = _check_tools(tools)
        if tool_choice is None:
            tool_choice = "auto" if checked else "none"
        plan = cls(tools=checked, parser_cls=parser_cls, parallel=parallel is not False)
        if tool_choice == "none":
            return plan
        if not checked:
            raise bad_request("tool_choice needs tools.", "tool_choice")
        if tool_choice == "auto":
            if not auto_enabled or parser_cls is None:
                raise bad_request('"auto" tool choice needs the server started with --enable-auto-tool-choice and '
                                  "--tool-call-parser.", "tool_choice")
            plan.mode = "auto"
            return plan
        if tool_choice == "required":
            plan.mode = "required"
            return plan
        if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
                and isinstance(tool_choice.get("function"), dict):
            name = tool_choice["function"].get("name")
            if name not in {t["function"]["name"] for t in checked}:
                raise bad_request(f"tool_choice names the function {name!r}, which is not among the tools.",
                                  "tool_choice")
            plan.mode, plan.function = "named", name
            return plan
        raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                          '{"name": ...}}.', "tool_choice")

    def constraint(self) -> Optional[Tuple[str, StructuredOutputsParams]]:
        """The output constraint this plan needs (required / named), as the request field it comes from."""
        if self.mode == "required":
            schema = required_calls_schema(self.tools)
            if not self.parallel:
                schema["maxItems"] = 1
            return "tool_choice", StructuredOutputsParams(json=schema)
        if self.mode == "named":
            f = next(t["function"] for t in self.tools if t["function"]["name"] == self.function)
            return "tool_choice", StructuredOutputsParams(json=f.get("parameters") or {"type": "object"})
        return None


def _check_tools(tools: Any) -> List[Dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of tools.", "tools")
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(f, dict):
            raise bad_request(f'tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}.', "tools")
        if not isinstance(f.get("name"), str) or not f["name"]:
            raise bad_request(f"tools[{i}].function needs a name.", "tools")
        params = f.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object.", "tools")
    return tools


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
