"""Tokenizer loading and prompt encoding, through transformers' AutoTokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """The tokenizer of a checkpoint directory, a hub id, or a GGUF file (built by transformers from the file's
    tokenizer.ggml.* metadata: vocabulary, merges, special tokens, and tokenizer.chat_template)."""
    from transformers import AutoTokenizer

    p = Path(path)
    if p.suffix == ".gguf" and p.is_file():
        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name, trust_remote_code=trust_remote_code)
    if p.is_dir() and not any((p / f).exists() for f in (
            "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")):
        raise FileNotFoundError(f"No tokenizer files (tokenizer.json, tokenizer_config.json, ...) in {path}.")
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def encode(tokenizer, text: str, add_special_tokens: bool = True) -> List[int]:
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def render_chat(tokenizer, messages, chat_template: Optional[str] = None,
                add_generation_prompt: bool = True) -> str:
    """The prompt text of a conversation, through the tokenizer's (or the given) chat template."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("This model's tokenizer has no chat template; pass one (chat_template=... or "
                         "--chat-template FILE).")
    return tokenizer.apply_chat_template(messages, tokenize=False, chat_template=chat_template,
                                         add_generation_prompt=add_generation_prompt)
