"""ReasoningParser: a thinking model's output -> reasoning_content apart from content.

qwen3 and deepseek_r1 write their reasoning between <think> and </think>. DeepSeek-R1 (and its distills) often
has the opening tag in the prompt (the chat template ends with "<think>\\n"), so its output is reasoning until
</think>, and all of it if the tag never closes. Qwen3 reasons only when thinking is on: its output is
reasoning when it opens with <think> (or the prompt ends inside an open <think>, as the thinking-only
templates do), otherwise all of it is content (enable_thinking=False)."""

from __future__ import annotations

from typing import Optional, Tuple

THINK_START = "<think>"
THINK_END = "</think>"


class ReasoningParser:
    name = ""
    # Whether an output whose reasoning never closes is reasoning (deepseek_r1) or content (qwen3).
    unclosed_is_reasoning = True

    def constraint_waits(self, prompt: str) -> bool:
        """Whether an output constraint (structured outputs, tool_choice required / named) should wait for the
        reasoning to end: unless the prompt has already closed it (thinking turned off in the template)."""
        return not prompt.rstrip().endswith(THINK_END)

    def starts_in_reasoning(self, prompt: str, output_start: str) -> Optional[bool]:
        """Whether the output begins inside the reasoning; None while output_start is too short to say."""
        if prompt.rstrip().endswith(THINK_START):
            return True
        s = output_start.lstrip()
        if s.startswith(THINK_START):
            return True
        if not s or THINK_START.startswith(s):
            return None
        return self.unclosed_is_reasoning

    def split(self, prompt: str, text: str) -> Tuple[Optional[str], Optional[str]]:
        """A whole output -> (reasoning_content, content); either may be None."""
        inside = self.starts_in_reasoning(prompt, text)
        if inside is None:
            inside = self.unclosed_is_reasoning and bool(text)
        if not inside:
            return None, text
        body = text.lstrip()
        if body.startswith(THINK_START):
            body = body[len(THINK_START):]
        if THINK_END in body:
            reasoning, content = body.split(THINK_END, 1)
        elif self.unclosed_is_reasoning or prompt.rstrip().endswith(THINK_START) \
                or text.lstrip().startswith(THINK_START):
            reasoning, content = body, ""
        else:
            return None, text
        return reasoning, (content.lstrip("\n") or None)


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    unclosed_is_reasoning = False


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    unclosed_is_reasoning = True
