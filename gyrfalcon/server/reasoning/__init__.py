"""Reasoning parsers by --reasoning-parser name (vLLM's names)."""

from gyrfalcon.server.reasoning.parser import DeepSeekR1ReasoningParser, Qwen3ReasoningParser, ReasoningParser
from gyrfalcon.server.reasoning.streaming import ReasoningStreamer

REASONING_PARSERS = {"qwen3": Qwen3ReasoningParser, "deepseek_r1": DeepSeekR1ReasoningParser}

__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningStreamer"]
