"""A verify step (speculative decoding): every sequence carries 1 + k new tokens (k = 0..4) over its cached prefix.
Through the whole model, with the reference attention backend and with the Triton one (its kernels in the
interpreter off a GPU), the logits of such a step equal those of running the same tokens one at a time."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig

import gyrfalcon.layers.attention.layer as attention_layer
from gyrfalcon.forward_context import forward_context
from gyrfalcon.layers.attention.reference import ReferenceBackend
from gyrfalcon.models.loader import load_model

BS = 8
PREFIX = [6, 13, 9]
TABLES = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


def _batch(starts, n):
    pos, slots, qsl = [], [], [0]
    for s, table in zip(starts, TABLES):
        for p in range(s, s + n):
            pos.append(p)
            slots.append(table[p // BS] * BS + p % BS)
        qsl.append(qsl[-1] + n)
    return SimpleNamespace(positions=torch.tensor(pos), slot_mapping=torch.tensor(slots),
                           query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                           seq_lens=torch.tensor([s + n for s in starts], dtype=torch.int32),
                           block_tables=torch.tensor(TABLES, dtype=torch.int32), is_decode=n == 1, max_query_len=n,
                           max_seq_len=max(starts) + n, num_seqs=len(starts), decode_num_splits=None)


def _run(model, caches, fb, ids):
    with torch.no_grad(), forward_context(fb, caches):
        return model.compute_logits(model(ids, fb.positions))


@pytest.fixture(scope="module")
def model_and_prefix(tiny_ckpt):
    hf = AutoConfig.from_pretrained(str(tiny_ckpt))
    model = load_model(SimpleNamespace(model=str(tiny_ckpt), hf_config=hf, torch_dtype=torch.float32,
                                       max_model_len=128), "cpu")
    cfg = model.config
    shape = (len(TABLES) * 3, BS, cfg.num_key_value_heads, cfg.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_hidden_layers)]
    g = torch.Generator().manual_seed(0)
    prefix_ids = torch.randint(1, cfg.vocab_size, (sum(PREFIX),), generator=g)
    # The prefixes as one ragged prefill (reference backend: CPU tensors).
    pos, slots = [], []
    for n, table in zip(PREFIX, TABLES):
        for p in range(n):
            pos.append(p)
            slots.append(table[p // BS] * BS + p % BS)
    qsl = torch.tensor([0, PREFIX[0], PREFIX[0] + PREFIX[1], sum(PREFIX)], dtype=torch.int32)
    fb = SimpleNamespace(positions=torch.tensor(pos), slot_mapping=torch.tensor(slots), query_start_loc=qsl,
                         seq_lens=torch.tensor(PREFIX, dtype=torch.int32),
                         block_tables=torch.tensor(TABLES, dtype=torch.int32), is_decode=False,
                         max_query_len=max(PREFIX), max_seq_len=max(PREFIX), num_seqs=3, decode_num_splits=None)
    _run(model, caches, fb, prefix_ids)
    return model, caches, cfg.vocab_size


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_verify_step_logits_match_one_token_at_a_time(model_and_prefix, backend, monkeypatch):
    model, prefix_caches, vocab = model_and_prefix
    if backend == "triton":
        pytest.importorskip("triton")
        from gyrfalcon.layers.attention.triton import TritonBackend
        be = TritonBackend()
    else:
        be = ReferenceBackend()
    monkeypatch.setattr(attention_layer, "get_backend", lambda device: be)
    # One set of 5 tokens per sequence, run one at a time once; the verify step of k drafts takes each sequence's
    # first 1 + k of them (k = 0 is itself the first one-token step).
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (3, 5), generator=g)
    caches = [tuple(t.clone() for t in c) for c in prefix_caches]
    singles = torch.stack([_run(model, caches, _batch([p + j for p in PREFIX], 1), ids[:, j]) for j in range(5)], 1)
    for k in range(1, 5):
        n = 1 + k
        caches = [tuple(t.clone() for t in c) for c in prefix_caches]
        verify = _run(model, caches, _batch(PREFIX, n), ids[:, :n].reshape(-1))
        torch.testing.assert_close(verify, singles[:, :n].reshape(3 * n, -1), rtol=1e-4, atol=1e-4)
