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
        return _gguf_tokenizer(p, trust_remote_code)
    if p.is_dir() and not any((p / f).exists() for f in (
            "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")):
        raise FileNotFoundError(f"No tokenizer files (tokenizer.json, tokenizer_config.json, ...) in {path}.")
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def _gguf_tokenizer(path: Path, trust_remote_code: bool):
    """transformers builds a GGUF file's tokenizer from its metadata, which takes seconds (SmolLM2's: ~3.5 s, most
    of it reading 49k token strings and 49k merges one by one), in the server's front end and its engine core
    alike. The result is kept as tokenizer files under ~/.cache/gyrfalcon/gguf-tokenizers/, keyed by the file's
    path, size and modification time and by the transformers version, so later starts read it in ~0.3 s."""
    import hashlib
    import os
    import shutil
    import tempfile

    import transformers
    from transformers import AutoTokenizer

    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}".encode())
    cache = Path.home() / ".cache" / "gyrfalcon" / "gguf-tokenizers" / key.hexdigest()[:24]
    if (cache / "tokenizer.json").exists():
        try:
            return AutoTokenizer.from_pretrained(str(cache), trust_remote_code=trust_remote_code)
        except (OSError, ValueError):
            pass  # unreadable: rebuilt from the file below
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, trust_remote_code=trust_remote_code)
    try:
        # Written beside the final folder and renamed into place: the server's two processes may race here.
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cache.parent, prefix=".tmp-"))
        tok.save_pretrained(str(tmp))
        try:
            os.replace(tmp, cache)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # another process got there first
    except OSError:
        pass  # a read-only home: no cache, the next start rebuilds it
    return tok


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
