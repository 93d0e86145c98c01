"""Qwen3-MoE vs transformers on a tiny random checkpoint (fp32, CPU): the dense families' parity suite
(test_model_parity.py: greedy tokens through chunked prefill, prefix caching, preemption and async scheduling;
logits at every prefill and decode position) on a checkpoint with sparse and dense (mlp_only_layers) layers,
plus the loading of per-expert tensors into the stacked w13 / w2."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from checkpoints import make_moe_checkpoint
from gyrfalcon import LLM
from gyrfalcon.layers.mlp import GatedMLP
from gyrfalcon.layers.moe import SparseMoE
from test_model_parity import (  # noqa: F401  (the shared suite, run here on this family's checkpoint)
    hf_refs, test_decode_logits_parity, family_greedy_parity as test_greedy_parity,
    family_greedy_parity_under_preemption as test_greedy_parity_under_preemption, test_prefill_logits_parity,
    test_prompts_span_several_blocks, test_unfused_path_parity)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    return make_moe_checkpoint(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe")


def test_checkpoint_is_fully_random(tiny_ckpt):
    sd = load_file(str(next(tiny_ckpt.glob("*.safetensors"))))
    for name, t in sd.items():
        assert t.unique().numel() > 1, name  # no constant tensor (zeros / ones) left from the init
    assert any(".mlp.experts.7.down_proj.weight" in n for n in sd)


def test_experts_stacked_and_dense_layers(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), block_size=8)
    layers = llm.engine.runner.model.model.layers
    assert [type(layer.mlp) for layer in layers] == [SparseMoE, GatedMLP, SparseMoE]
    sd = load_file(str(next(tiny_ckpt.glob("*.safetensors"))))
    moe = layers[2].mlp
    for e in (0, 5):
        p = f"model.layers.2.mlp.experts.{e}."
        torch.testing.assert_close(moe.experts.w13[e], torch.cat([sd[p + "gate_proj.weight"],
                                                                  sd[p + "up_proj.weight"]]), rtol=0, atol=0)
        torch.testing.assert_close(moe.experts.w2[e], sd[p + "down_proj.weight"], rtol=0, atol=0)
    torch.testing.assert_close(moe.gate.weight, sd["model.layers.2.mlp.gate.weight"], rtol=0, atol=0)


def _preset_loads(preset: str, num_layers: int) -> None:
    """The make-checkpoint preset's tensors (names and shapes as it writes them, on the meta device) fill
    gyrfalcon's model exactly: every expected weight, nothing left over."""
    from transformers import AutoModelForCausalLM

    from gyrfalcon.bench.make_checkpoint import build_config, checkpoint_entries
    from gyrfalcon.models.registry import resolve_model_class

    cfg = build_config(preset, num_layers)
    with torch.device("meta"):
        state = AutoModelForCausalLM.from_config(cfg).state_dict()
        model = resolve_model_class(cfg)(cfg, max_position=64)
    tensors = [(n, torch.empty(s, device="meta")) for name, meta in state.items()
               for n, s in checkpoint_entries(cfg.model_type, name, meta.shape)]
    assert model.load_weights(tensors) == model.expected_weights()
    return [n for n, _ in tensors]


def test_make_checkpoint_preset():
    names = _preset_loads("qwen3-30b-a3b", 2)
    assert "model.layers.1.mlp.experts.127.down_proj.weight" in names
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in names
    assert not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in names)
