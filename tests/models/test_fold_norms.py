"""Norm folding as a load-time pass: load_model folds every norm that feeds a linear layer (fold_norms) unless
fusion is disabled, and the folded model's logits match the same checkpoint's unfolded ones, on prompt chunks
(folded: no norm launch) and single-row decode steps (the norm inside the GEMV)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers import AutoConfig

from gyrfalcon.forward_context import forward_context
from gyrfalcon.layers.norm_linear import NormLinear, fold_norms
from gyrfalcon.models.loader import iterate_safetensors, load_model
from gyrfalcon.models.registry import resolve_model_class

BS = 8


def _model_config(ckpt):
    return SimpleNamespace(model=str(ckpt), hf_config=AutoConfig.from_pretrained(str(ckpt)), torch_dtype=torch.float32,
                           max_model_len=128)


def _unfolded(ckpt):
    mc = _model_config(ckpt)
    model = resolve_model_class(mc.hf_config)(mc.hf_config, max_position=mc.max_model_len)
    model.load_weights(iterate_safetensors(str(ckpt)))
    return model.eval()


def _batch(start: int, n: int):
    """One sequence, n tokens from position start, blocks 0, 1, 2, ... (the tests' fields of a ForwardBatch)."""
    pos = torch.arange(start, start + n)
    return SimpleNamespace(positions=pos, slot_mapping=pos.clone(),
                           query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                           seq_lens=torch.tensor([start + n], dtype=torch.int32),
                           block_tables=torch.arange(16, dtype=torch.int32)[None], is_decode=n == 1,
                           max_query_len=n, max_seq_len=start + n, num_seqs=1, decode_num_splits=None)


def _logits(model, ids):
    """A 9-token prompt chunk, a 3-token chunk over it, then 4 decode steps: logits of every token."""
    cfg = model.config
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    shape = (16, BS, cfg.num_key_value_heads, hd)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_hidden_layers)]
    out, start = [], 0
    for n in (9, 3, 1, 1, 1, 1):
        fb = _batch(start, n)
        with torch.no_grad(), forward_context(fb, caches):
            out.append(model.compute_logits(model(ids[start:start + n], fb.positions)))
        start += n
    return torch.cat(out)


def test_fold_is_a_load_time_pass(tiny_ckpt):
    ids = torch.tensor([5, 17, 3, 99, 42, 7, 7, 250, 11, 64, 2, 31, 8, 19, 77, 5])
    model = _unfolded(tiny_ckpt)
    pairs = [m for m in model.modules() if isinstance(m, NormLinear)]
    assert len(pairs) == 2 * model.config.num_hidden_layers and not any(p.folded for p in pairs)
    assert pairs[0].plan(9) == "separate" and pairs[0].plan(1) == "gemv"
    before = _logits(model, ids)
    assert fold_norms(model) == len(pairs)
    assert pairs[0].plan(9) == "folded" and pairs[0].plan(1) == "gemv"
    torch.testing.assert_close(_logits(model, ids), before, rtol=1e-4, atol=1e-4)
    loaded = load_model(_model_config(tiny_ckpt), "cpu")  # the loader runs the pass
    assert all(m.folded for m in loaded.modules() if isinstance(m, NormLinear))
    for a, b in zip(loaded.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_loader_folds_nothing_without_fusion(tiny_ckpt, monkeypatch):
    monkeypatch.setenv("GYRFALCON_DISABLE_FUSION", "1")
    model = load_model(_model_config(tiny_ckpt), "cpu")
    assert not any(m.folded for m in model.modules() if isinstance(m, NormLinear))
    w = model.model.layers[0].input_layernorm.weight
    assert not torch.equal(w, torch.ones_like(w))
