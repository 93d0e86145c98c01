"""Incremental detokenization: text grows token by token, never half a multi-byte character.

Decoding a single token in isolation is wrong for byte-level BPE (a character may span tokens) and
for sentencepiece (a leading space depends on the token before). So each step decodes a short
window: the tokens since the last emitted boundary (prefix) with and without the new tokens, and
emits the difference once it no longer ends in U+FFFD (an incomplete UTF-8 sequence).
"""

from __future__ import annotations

from typing import List

# Prompt tokens kept as left context, so the first output token decodes with its true spacing.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: List[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens: List[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.output_text = ""

    def _decode(self, ids: List[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def add_token(self, token_id: int, final: bool = False) -> str:
        """Append one token; return the text it completes ("" while a character is unfinished).
        final=True flushes whatever is pending (the request ended)."""
        return self.add_tokens([token_id], final)

    def add_tokens(self, token_ids: List[int], final: bool = False) -> str:
        """Append several tokens with one pair of decodes (same text as adding them one by one)."""
        if not token_ids:
            return ""
        self.tokens.extend(token_ids)
        prefix_text = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.tokens[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith("\ufffd")):
            delta = new_text[len(prefix_text):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
            self.output_text += delta
            return delta
        return ""

    def flush(self) -> str:
        """Emit text still held back at the end of a request (an unfinished character)."""
        if self.read_offset >= len(self.tokens):
            return ""
        prefix_text = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.tokens[self.prefix_offset:])
        delta = new_text[len(prefix_text):]
        self.prefix_offset = self.read_offset = len(self.tokens)
        self.output_text += delta
        return delta
