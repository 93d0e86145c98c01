"""ReasoningStreamer: one choice's streamed text -> (reasoning delta, content delta) pairs, with the same split as
ReasoningParser.split on the whole text. Text that could still be the start of <think> or </think> is held back
until the next delta says."""

from __future__ import annotations

from typing import Optional, Tuple

from gyrfalcon.server.reasoning.parser import THINK_END, THINK_START, ReasoningParser


def _partial_tail(text: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ReasoningStreamer:
    def __init__(self, parser: ReasoningParser, prompt: str) -> None:
        self.parser = parser
        self.prompt = prompt
        self.text = ""
        self.state: Optional[str] = None  # None: undecided; "reasoning"; "content"
        self.pos = 0  # characters of text handled

    def feed(self, delta: str, final: bool = False) -> Tuple[str, str]:
        self.text += delta
        reasoning = content = ""
        if self.state is None:
            inside = self.parser.starts_in_reasoning(self.prompt, self.text)
            if inside is None and not final:
                return "", ""
            self.state = "reasoning" if inside else "content"
            s = self.text.lstrip()
            if inside and s.startswith(THINK_START):
                self.pos = len(self.text) - len(s) + len(THINK_START)
        if self.state == "reasoning":
            rest = self.text[self.pos:]
            end = rest.find(THINK_END)
            if end >= 0:
                reasoning = rest[:end]
                self.pos += end + len(THINK_END)
                self.state = "after"
            else:
                keep = 0 if final else _partial_tail(rest, THINK_END)
                reasoning = rest[:len(rest) - keep]
                self.pos += len(reasoning)
                return reasoning, ""
        if self.state == "after":  # the newlines between </think> and the answer are not content
            rest = self.text[self.pos:]
            stripped = rest.lstrip("\n")
            self.pos += len(rest) - len(stripped)
            if stripped:
                self.state = "content"
        if self.state == "content":
            content = self.text[self.pos:]
            self.pos = len(self.text)
        return reasoning, content
