"""Reasoning parsers by --reasoning-parser name (vLLM's names)."""

from gyrfalcon.server.reasoning.parser import DeepSeekR1ReasoningParser, Qwen3ReasoningParser, ReasoningParser
from gyrfalcon.server.reasoning.streaming import ReasoningStreamer

# deepseek_v3 (V3.1 / V3.2, thinking switched by the template: "<think>" or "</think>" ends the prompt) reads as
# qwen3 does; minimax_m2 (always thinking, "</think>" closes it) as deepseek_r1 does.
REASONING_PARSERS = {"qwen3": Qwen3ReasoningParser, "deepseek_r1": DeepSeekR1ReasoningParser,
                     "deepseek_v3": Qwen3ReasoningParser, "minimax_m2": DeepSeekR1ReasoningParser}

__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningStreamer"]
