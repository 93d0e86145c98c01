"""Incremental detokenization: text grows token by token, never half a multi-byte character.

Decoding a single token in isolation is wrong for byte-level BPE (a character may span tokens) and
for sentencepiece (a leading space depends on the token before). So each step decodes a short
window: the tokens since the last emitted boundary (prefix) with and without the new tokens, and
emits the difference once it no longer ends in U+FFFD (an incomplete UTF-8 sequence).
"""

from __future__ import annotations

from typing import Dict, List, Sequence

# Prompt tokens kept as left context, so the first output token decodes with its true spacing.
_CONTEXT_TOKENS = 5


def fast_backend(tokenizer):
    """The Rust tokenizer behind a Hugging Face fast tokenizer whose decode is the base classes' own (the
    backend's decode, then a clean-up that gyrfalcon always turns off), else None. Decoding through it skips
    transformers' per-id Python checks (~60% of an offline batch's final detokenization on the CPU) and gives
    the same text; a tokenizer class that overrides decode keeps going through it."""
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except Exception:  # pragma: no cover - transformers is a dependency
        return None
    cls = type(tokenizer)
    if (isinstance(tokenizer, PreTrainedTokenizerFast) and cls._decode is PreTrainedTokenizerFast._decode
            and cls.decode is PreTrainedTokenizerBase.decode):
        return getattr(tokenizer, "backend_tokenizer", None)
    return None


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: List[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.backend = fast_backend(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.tokens: List[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.output_text = ""

    def _decode(self, ids: List[int]) -> str:
        if self.backend is not None:
            return self.backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
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
        prefix_ids, all_ids = self._windows()
        before = len(self.output_text)
        self._finish(self._decode(prefix_ids), self._decode(all_ids))
        return self.output_text[before:]

    def extend(self, token_ids: List[int]) -> None:
        """Append tokens without decoding them (finish_all decodes what is pending, for many at once)."""
        self.tokens.extend(token_ids)

    def _windows(self):
        return self.tokens[self.prefix_offset:self.read_offset], self.tokens[self.prefix_offset:]

    def _finish(self, prefix_text: str, new_text: str) -> None:
        self.output_text += new_text[len(prefix_text):]
        self.prefix_offset = self.read_offset = len(self.tokens)


def finish_all(detoks: Sequence[IncrementalDetokenizer]) -> None:
    """Emit every pending token of each detokenizer, as add_tokens(pending) then flush() would (the request
    ended), with the windows of all that share a fast backend decoded in one decode_batch call (the offline
    generate's last step finishes a whole batch at once)."""
    groups: Dict[tuple, List[IncrementalDetokenizer]] = {}
    for d in detoks:
        if d.read_offset < len(d.tokens):
            key = (id(d.backend), d.skip_special_tokens) if d.backend is not None else None
            groups.setdefault(key, []).append(d)
    for key, ds in groups.items():
        windows = [w for d in ds for w in d._windows()]  # (prefix, prefix + pending) per detokenizer
        if key is not None:
            texts = ds[0].backend.decode_batch(windows, skip_special_tokens=ds[0].skip_special_tokens)
        else:  # each through its own tokenizer and flag
            texts = [ds[i // 2]._decode(w) for i, w in enumerate(windows)]
        for i, d in enumerate(ds):
            d._finish(texts[2 * i], texts[2 * i + 1])
