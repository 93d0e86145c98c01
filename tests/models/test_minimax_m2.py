"""MiniMax-M2 vs transformers on a tiny random checkpoint (fp32, CPU): the dense families' parity suite
(test_model_parity.py: greedy tokens through chunked prefill, prefix caching, preemption and async scheduling;
logits at every prefill and decode position) on ../shared/MODELS.md's tiny config (whole-projection QK-norm,
partial rotary, GQA, sigmoid routing with a random e_score_correction_bias), plus its loading: per-expert
w1 / w3 / w2 stacked, the correction bias, MTP tensors skipped."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from checkpoints import make_moe_checkpoint
from gyrfalcon import LLM
from gyrfalcon.layers.moe import SparseMoE
from gyrfalcon.models.minimax_m2 import MiniMaxM2ForCausalLM
from test_model_parity import (  # noqa: F401  (the shared suite, run here on this family's checkpoint)
    hf_refs, test_decode_logits_parity, family_greedy_parity as test_greedy_parity,
    family_greedy_parity_under_preemption as test_greedy_parity_under_preemption, test_prefill_logits_parity,
    test_prompts_span_several_blocks, test_unfused_path_parity)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    return make_moe_checkpoint(tmp_path_factory.mktemp("minimax_m2"), "minimax_m2")


def test_checkpoint_is_fully_random(tiny_ckpt):
    sd = load_file(str(next(tiny_ckpt.glob("*.safetensors"))))
    for name, t in sd.items():
        assert t.unique().numel() > 1, name
    assert sd["model.layers.1.block_sparse_moe.e_score_correction_bias"].abs().min() > 0


def test_loading(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), block_size=8)
    layers = llm.engine.runner.model.model.layers
    sd = load_file(str(next(tiny_ckpt.glob("*.safetensors"))))
    moe = layers[1].mlp
    assert isinstance(moe, SparseMoE) and moe.gate.scoring == "sigmoid"
    p = "model.layers.1.block_sparse_moe."
    for e in (0, 7):
        torch.testing.assert_close(moe.experts.w13[e], torch.cat([sd[f"{p}experts.{e}.w1.weight"],
                                                                  sd[f"{p}experts.{e}.w3.weight"]]), rtol=0, atol=0)
        torch.testing.assert_close(moe.experts.w2[e], sd[f"{p}experts.{e}.w2.weight"], rtol=0, atol=0)
    torch.testing.assert_close(moe.gate.e_score_correction_bias, sd[p + "e_score_correction_bias"], rtol=0, atol=0)
    attn = layers[0].self_attn
    assert attn.q_norm.weight.shape == (4 * 16,) and attn.k_norm.weight.shape == (2 * 16,)
    assert attn.rotary_emb.rotary_dim == 8


def test_mtp_weights_skipped(tiny_ckpt):
    """Real checkpoints carry multi-token-prediction modules as layers past num_hidden_layers: not loaded here."""
    sd = load_file(str(next(tiny_ckpt.glob("*.safetensors"))))
    extra = {k.replace("model.layers.1.", "model.layers.2."): v for k, v in sd.items() if k.startswith("model.layers.1.")}
    from transformers import AutoConfig
    model = MiniMaxM2ForCausalLM(AutoConfig.from_pretrained(str(tiny_ckpt)))
    loaded = model.load_weights(list(sd.items()) + list(extra.items()))
    assert loaded == model.expected_weights()
    assert not any("layers.2." in n for n in loaded)


def test_make_checkpoint_preset():
    from test_qwen3_moe import _preset_loads

    names = _preset_loads("minimax-m2", 2)
    assert "model.layers.1.block_sparse_moe.experts.255.w2.weight" in names
    assert "model.layers.0.block_sparse_moe.e_score_correction_bias" in names
    assert not any(".mlp." in n for n in names)
