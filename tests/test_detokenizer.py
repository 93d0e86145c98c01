"""detokenizer.py's fast paths against the tokenizer's own decode: the Rust backend's decode gives the text that
transformers' decode gives, and finish_all (a batch's deferred texts in one decode_batch) gives what add_tokens +
flush gave one sample at a time, on random ids (special tokens and multi-byte characters included)."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from gyrfalcon.detokenizer import IncrementalDetokenizer, fast_backend, finish_all

DEMO = "gyrfalcon/assets/demo-model"


@pytest.fixture(scope="module")
def tokenizers():
    from gyrfalcon.bench.make_checkpoint import train_tokenizer
    return {"demo": AutoTokenizer.from_pretrained(DEMO), "bench-bpe": train_tokenizer(512)}


class _SlowDecode:
    """A tokenizer whose decode is its own Python (as a class overriding decode would be): no fast backend."""

    def __init__(self, tok):
        self.tok = tok

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


def _samples(tok, rng, n):
    text_ids = tok("naïve café 東京 😀 “x” done", add_special_tokens=False)["input_ids"]
    special = list(tok.all_special_ids) or [0]
    V = len(tok)
    out = []
    for _ in range(n):
        ids = [rng.choice([rng.randrange(V), rng.choice(special), rng.choice(text_ids)]) for _ in range(rng.randrange(0, 40))]
        out.append(ids)
    return out


@pytest.mark.parametrize("name", ["demo", "bench-bpe"])
def test_backend_decode_is_the_tokenizers(tokenizers, name):
    tok = tokenizers[name]
    assert fast_backend(tok) is not None
    assert fast_backend(_SlowDecode(tok)) is None
    rng = random.Random(0)
    for ids in _samples(tok, rng, 200):
        for skip in (True, False):
            d = IncrementalDetokenizer(tok, [], skip)
            assert d._decode(ids) == tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("name", ["demo", "bench-bpe"])
def test_finish_all_matches_add_tokens_then_flush(tokenizers, name):
    tok = tokenizers[name]
    rng = random.Random(1)
    prompts = _samples(tok, rng, 60)
    outs = _samples(tok, rng, 60)
    for wrap in (lambda t: t, _SlowDecode):
        want, batch = [], []
        for i, (p, o) in enumerate(zip(prompts, outs)):
            skip = i % 3 != 0  # two groups: skip_special_tokens True and False
            a = IncrementalDetokenizer(wrap(tok), p, skip)
            head = rng.randrange(0, len(o) + 1)  # some tokens already emitted token by token
            for t in o[:head]:
                a.add_token(t)
            b = IncrementalDetokenizer(wrap(tok), p, skip)
            for t in o[:head]:
                b.add_token(t)
            a.add_tokens(o[head:])
            a.flush()
            b.extend(o[head:])
            want.append(a.output_text)
            batch.append(b)
        finish_all(batch)
        assert [b.output_text for b in batch] == want
        assert all(b.read_offset == len(b.tokens) for b in batch)
