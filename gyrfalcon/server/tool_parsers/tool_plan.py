"""ToolPlan: a chat request's `tools` and `tool_choice`, checked, and how its calls are produced:
- "none" (or no tools): plain text; tools still go to the chat template, as vLLM does;
- "auto": the model writes calls in its own syntax; --tool-call-parser reads them (needs
  --enable-auto-tool-choice);
- "required": the output is constrained (structured outputs) to a JSON array of {"name", "parameters"} items over
  the tools, so it always parses, into one call per item;
- a named function: the output is constrained to that function's parameters schema and is its arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Type

from gyrfalcon.sampling_params import StructuredOutputsParams
from gyrfalcon.server.protocol import bad_request
from gyrfalcon.server.tool_parsers.base import ToolParser
from gyrfalcon.server.tool_parsers.json_array import required_calls_schema


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
