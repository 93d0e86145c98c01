"""The reasoning parsers on scripted outputs, whole and streamed in every split."""

from __future__ import annotations

import random

import pytest

from gyrfalcon.server.reasoning import REASONING_PARSERS, ReasoningStreamer

CASES = [
    # (parser, prompt end, output, reasoning, content)
    ("qwen3", "<|im_start|>assistant\n", "<think>\nLet me add.\n</think>\n\nIt is 4.", "\nLet me add.\n", "It is 4."),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "It is 4.", None, "It is 4."),  # thinking off
    ("qwen3", "<|im_start|>assistant\n", "It is <b>4</b>.", None, "It is <b>4</b>."),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "Hmm, 2+2.</think>4", "Hmm, 2+2.", "4"),  # thinking-only template
    ("qwen3", "<|im_start|>assistant\n", "<think>unfinished", "unfinished", None),
    ("deepseek_r1", "<｜Assistant｜><think>\n", "2+2 is 4.\n</think>\n\nFour.", "2+2 is 4.\n", "Four."),
    ("deepseek_r1", "<｜Assistant｜>", "<think>x</think>y", "x", "y"),
    ("deepseek_r1", "<｜Assistant｜>", "still thinking", "still thinking", None),
    ("deepseek_v3", "<｜Assistant｜><think>", "plan</think>done", "plan", "done"),  # V3.1, thinking on
    ("deepseek_v3", "<｜Assistant｜></think>", "done", None, "done"),  # thinking off
    ("minimax_m2", "]~b]ai\n", "<think>\nplan\n</think>\n\nOK", "\nplan\n", "OK"),
]


@pytest.mark.parametrize("name, prompt, text, reasoning, content", CASES)
def test_split_whole_and_streamed(name, prompt, text, reasoning, content):
    parser = REASONING_PARSERS[name]()
    assert parser.split(prompt, text) == (reasoning, content)
    rng = random.Random(0)
    for _ in range(20):
        s = ReasoningStreamer(parser, prompt)
        r = c = ""
        i = 0
        while i < len(text):
            j = min(len(text), i + rng.randint(1, 5))
            dr, dc = s.feed(text[i:j], final=(j == len(text)))
            r, c = r + dr, c + dc
            i = j
        assert r == (reasoning or "") and c == (content or "")
