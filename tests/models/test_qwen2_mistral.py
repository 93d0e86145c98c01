"""Qwen2 (q/k/v biases) and Mistral vs transformers on tiny random checkpoints (fp32, CPU): the dense families'
parity suite (test_model_parity.py: greedy tokens through chunked prefill, prefix caching, preemption and
async scheduling; logits at every prefill and decode position), plus the biases' loading and the sliding-window
guard."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from checkpoints import make_checkpoint
from gyrfalcon import LLM
from test_model_parity import (  # noqa: F401  (the shared suite, run here on these families' checkpoints)
    hf_refs, test_decode_logits_parity, family_greedy_parity as test_greedy_parity,
    family_greedy_parity_under_preemption as test_greedy_parity_under_preemption, test_prefill_logits_parity,
    test_prompts_span_several_blocks)


@pytest.fixture(scope="module", params=["qwen2", "mistral"])
def tiny_ckpt(request, tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


def test_qkv_biases_loaded(tmp_path):
    """Qwen2's q/k/v biases land in the fused qkv bias [(H + 2 KV) * D] in q, k, v order (o_proj has none)."""
    ckpt = make_checkpoint(tmp_path / "qwen2", "qwen2", num_hidden_layers=1)
    sd = load_file(str(next(ckpt.glob("*.safetensors"))))
    attn = LLM(str(ckpt), block_size=8).engine.runner.model.model.layers[0].self_attn
    p = "model.layers.0.self_attn."
    want = torch.cat([sd[p + "q_proj.bias"], sd[p + "k_proj.bias"], sd[p + "v_proj.bias"]])
    assert want.abs().min() > 0  # random, so a bias left at zero would show
    torch.testing.assert_close(attn.qkv_proj.bias, want, rtol=0, atol=0)
    assert getattr(attn.o_proj, "bias", None) is None


def test_mistral_sliding_window_guard(tmp_path):
    """A sliding window smaller than max_model_len is refused by name (gyrfalcon attends over the full context);
    one that no sequence can outgrow loads."""
    ckpt = make_checkpoint(tmp_path / "mistral", "mistral", num_hidden_layers=1, sliding_window=64)
    with pytest.raises(ValueError, match=r"sliding_window=64.*--max-model-len 64"):
        LLM(str(ckpt), block_size=8)
    llm = LLM(str(ckpt), block_size=8, max_model_len=64)
    assert llm.config.model_config.max_model_len == 64
