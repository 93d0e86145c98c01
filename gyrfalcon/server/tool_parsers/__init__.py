"""Tool-call parsers by --tool-call-parser name (vLLM's names). Light to import (the CLI reads the names);
tool_plan.py, which needs the server's protocol, is imported from its module."""

from __future__ import annotations

from typing import Dict, Type

from gyrfalcon.server.tool_parsers.base import ExtractedToolCalls, ToolCall, ToolParser
from gyrfalcon.server.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from gyrfalcon.server.tool_parsers.hermes import HermesToolParser
from gyrfalcon.server.tool_parsers.json_array import JsonArrayToolParser, required_calls_schema
from gyrfalcon.server.tool_parsers.llama3_json import Llama3JsonToolParser
from gyrfalcon.server.tool_parsers.minimax_m2 import MiniMaxM2ToolParser
from gyrfalcon.server.tool_parsers.streaming import ToolCallStreamer

TOOL_PARSERS: Dict[str, Type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen3": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "deepseek_v3": DeepSeekV3ToolParser,
    "deepseek_v31": DeepSeekV3ToolParser,
    "minimax_m2": MiniMaxM2ToolParser,
}

__all__ = ["TOOL_PARSERS", "ToolParser", "ToolCall", "ExtractedToolCalls", "ToolCallStreamer",
           "JsonArrayToolParser", "required_calls_schema"]
