"""Qwen3.5 vs transformers on tiny random checkpoints saved as the releases ship them (fp32, CPU): Qwen3.5-MoE
(Qwen3_5MoeForConditionalGeneration, experts packed as the bf16 releases store them) and dense Qwen3.5
(Qwen3_5ForConditionalGeneration), each with three Gated DeltaNet layers in the flat projection layout, one gated
attention layer under M-RoPE, a one-block vision tower that gyrfalcon skips, every parameter random. The oracle is
transformers' ConditionalGeneration model itself (its 3-D text positions, its multimodal rotary embedding). Prompts run
up to ~200 tokens, so prefill chunks cross the delta rule's 64-token chunks: logits at every prefill and decode
position, greedy tokens through chunked prefill (budgets 7 and 50), async scheduling, preemption, prefix caching
(state snapshots at block boundaries); the other layouts of
the same weights (experts one by one, a text-only *ForCausalLM save) load to the same model."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from checkpoints import make_qwen3_5_checkpoint
from gyrfalcon import LLM
from gyrfalcon.cache_spec import FullAttentionSpec, LinearStateSpec
from gyrfalcon.layers.gated_deltanet import GatedDeltaNet
from gyrfalcon.layers.mlp import GatedMLP
from gyrfalcon.layers.moe import SparseMoE
from gyrfalcon.layers.self_attention import RotarySelfAttention
from test_model_parity import (  # noqa: F401  (the shared suite where it applies to a state model)
    MAX_NEW, _assert_all_blocks_free, _greedy, test_decode_logits_parity, family_greedy_parity_under_preemption as
    test_greedy_parity_under_preemption, test_prompts_span_several_blocks)
from test_qwen3_next import QN_PROMPTS, test_prefill_logits_parity  # noqa: F401  (on this module's checkpoints)
from test_qwen3_next_prefix_caching import Oracle, shared_prefix_parity

PREFIX = "model.language_model.layers"


@pytest.fixture(scope="module", params=["moe", "dense"])
def tiny_ckpt(request, tmp_path_factory):
    return make_qwen3_5_checkpoint(tmp_path_factory.mktemp(f"qwen3_5_{request.param}"), moe=request.param == "moe")


def _is_moe(ckpt) -> bool:
    return json.loads((ckpt / "config.json").read_text())["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]


def _hf_model(ckpt):
    from transformers import Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration

    cls = Qwen3_5MoeForConditionalGeneration if _is_moe(ckpt) else Qwen3_5ForConditionalGeneration
    return cls.from_pretrained(str(ckpt), dtype=torch.float32).eval()


class TextView:
    """transformers' ConditionalGeneration model as the shared suite reads it: config is the language model's."""

    def __init__(self, model) -> None:
        self.model, self.config = model, model.config.text_config

    def __call__(self, ids):
        return self.model(ids)


@pytest.fixture(scope="module")
def hf_refs(tiny_ckpt):
    """transformers' greedy continuations and their per-step logits, per prompt (Qwen3-Next's prompts: one of 1
    token, one of 64-128, one past 3 x 64)."""
    tok = AutoTokenizer.from_pretrained(str(tiny_ckpt))
    model = _hf_model(tiny_ckpt)
    refs = []
    for p in QN_PROMPTS:
        ids = tok(p, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        refs.append((ids[0].tolist(), out.sequences[0, ids.shape[1]:].tolist(),
                     torch.stack(out.logits, 0)[:, 0].float()))
    return tok, TextView(model), refs


def _assert_all_slots_free(llm):
    sm = llm.engine.scheduler.state_manager
    assert sm is not None and sm.num_free_slots == sm.num_slots


def _params(llm):
    return dict(llm.engine.runner.model.named_parameters())


def test_prompts_cross_gdn_chunks(hf_refs):
    _, _, refs = hf_refs
    lens = sorted(len(r[0]) for r in refs)
    assert lens[0] == 1 and lens[-1] > 3 * 64 and any(64 < n < 128 for n in lens)


def test_checkpoint_is_the_release_layout(tiny_ckpt):
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    assert "text_config" in cfg and "vision_config" in cfg and "num_hidden_layers" not in cfg
    assert cfg["text_config"]["rope_parameters"]["mrope_section"] == [2, 1, 1]
    sd = load_file(str(next(tiny_ckpt.glob("*.safetensors"))))
    for name, t in sd.items():
        assert t.unique().numel() > 1, name  # no constant tensor (zeros / ones) left from the init
    assert {f"{PREFIX}.0.linear_attn.in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")} <= set(sd)
    assert f"{PREFIX}.3.self_attn.q_norm.weight" in sd and "lm_head.weight" in sd
    assert any(n.startswith("model.visual.") for n in sd)
    assert not any(n.startswith("model.layers.") for n in sd)
    if _is_moe(tiny_ckpt):
        assert sd[f"{PREFIX}.2.mlp.experts.gate_up_proj"].shape == (8, 64, 64)  # packed [E, 2I, H]
        assert sd[f"{PREFIX}.2.mlp.experts.down_proj"].shape == (8, 64, 32)
        assert not any(".experts.0." in n for n in sd)
    else:
        assert f"{PREFIX}.2.mlp.gate_proj.weight" in sd


def test_layers_weights_and_caches(tiny_ckpt):
    """The engine serves text_config (4 layers, vocab 512, context 1024 from it); the flat GDN projections land as
    the shards of in_proj_qkvz / in_proj_ba, the packed experts in w13 / w2, unchanged."""
    llm = LLM(str(tiny_ckpt), block_size=8, max_num_seqs=5)
    mc = llm.config.model_config
    assert mc.hf_config.num_hidden_layers == 4 and mc.hf_config.vocab_size == 512 and mc.max_model_len == 1024
    assert mc.hf_config.architectures == json.loads((tiny_ckpt / "config.json").read_text())["architectures"]
    assert llm.engine.config.model_config.eos_token_ids(None) == [llm.tokenizer.eos_token_id]
    runner = llm.engine.runner
    model = runner.model
    layers = model.model.layers
    assert [type(layer.self_attn) for layer in layers] == [GatedDeltaNet] * 3 + [RotarySelfAttention]
    moe = _is_moe(tiny_ckpt)
    assert all(isinstance(layer.mlp, SparseMoE if moe else GatedMLP) for layer in layers)
    attn = layers[3].self_attn
    assert attn.output_gate and attn.q_norm.weight_offset == 1.0 and attn.rotary_emb.rotary_dim == 8
    assert all(n.weight_offset == 1.0 for layer in layers for n in (layer.input_layernorm,
                                                                    layer.post_attention_layernorm))
    assert model.model.norm.weight_offset == 1.0
    sd = load_file(str(next(tiny_ckpt.glob("*.safetensors"))))
    gdn = layers[1].self_attn
    exact = dict(rtol=0, atol=0)
    torch.testing.assert_close(gdn.in_proj_qkvz.weight, torch.cat([sd[f"{PREFIX}.1.linear_attn.in_proj_qkv.weight"],
                                                                   sd[f"{PREFIX}.1.linear_attn.in_proj_z.weight"]]),
                               **exact)
    torch.testing.assert_close(gdn.in_proj_ba.weight, torch.cat([sd[f"{PREFIX}.1.linear_attn.in_proj_b.weight"],
                                                                 sd[f"{PREFIX}.1.linear_attn.in_proj_a.weight"]]),
                               **exact)
    torch.testing.assert_close(model.lm_head.weight, sd["lm_head.weight"], **exact)
    if moe:
        experts = layers[2].mlp.experts
        torch.testing.assert_close(experts.w13, sd[f"{PREFIX}.2.mlp.experts.gate_up_proj"], **exact)
        torch.testing.assert_close(experts.w2, sd[f"{PREFIX}.2.mlp.experts.down_proj"], **exact)
        assert layers[2].mlp.shared_expert_gate is not None
    specs = model.kv_cache_specs("float32")
    assert specs[3] == FullAttentionSpec(2, 32, "float32")
    assert all(specs[i] == LinearStateSpec((3, 128), (4, 16, 16), "float32", "float32") for i in range(3))
    assert runner.num_state_slots == 5 and llm.engine.scheduler.state_manager.num_slots == 5


def test_other_layouts_load_the_same_weights(tiny_ckpt, tmp_path):
    """The same model saved as transformers writes it (experts one by one, as the FP8 releases store them) and as a
    text-only Qwen3_5*ForCausalLM (model.layers.*, no vision tower, text config at the top): every parameter
    identical to the release layout's."""
    from transformers import AutoModelForCausalLM

    want = _params(LLM(str(tiny_ckpt), block_size=8))
    layouts = []
    if _is_moe(tiny_ckpt):
        layouts.append(make_qwen3_5_checkpoint(tmp_path / "per_expert", packed_experts=False))
    text_only = tmp_path / "text_only"
    AutoModelForCausalLM.from_pretrained(str(tiny_ckpt), dtype=torch.float32).save_pretrained(str(text_only))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny_ckpt / f, text_only / f)
    cfg = json.loads((text_only / "config.json").read_text())
    assert cfg["architectures"][0].endswith("ForCausalLM") and "text_config" not in cfg
    layouts.append(text_only)
    for path in layouts:
        sd = load_file(str(next(path.glob("*.safetensors"))))
        assert not any(n.startswith("model.visual.") for n in sd) or path.name == "per_expert"
        got = _params(LLM(str(path), block_size=8))
        assert got.keys() == want.keys()
        for name, p in got.items():
            torch.testing.assert_close(p, want[name], rtol=0, atol=0, msg=f"{path.name}: {name}")


def test_top_level_settings_reach_the_text_config(tiny_ckpt, tmp_path):
    """What the release writes at the top of config.json and not in text_config: a quantization_config (FP8
    releases), tie_word_embeddings (transformers ties by the top-level flag); eos falls back to the top."""
    from gyrfalcon.config import ModelConfig

    path = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}
    cfg["tie_word_embeddings"] = True
    cfg["eos_token_id"] = 7
    cfg["text_config"]["eos_token_id"] = None
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "generation_config.json").unlink()
    mc = ModelConfig(str(path))
    mc.resolve("cpu")
    assert mc.hf_config.num_hidden_layers == 4 and mc.hf_config.tie_word_embeddings is True
    assert mc.quant_config.weight_block_size == (128, 128) and mc.quant_config.modules_to_not_convert == ["lm_head"]
    assert mc.eos_token_ids(None) == [7]


@pytest.mark.parametrize("budget,async_scheduling", [(None, False), (7, True), (50, False)],
                         ids=["whole-sync", "7-async", "50-sync"])
def test_greedy_parity(tiny_ckpt, hf_refs, budget, async_scheduling):
    """Chunked prefill at budgets 7 and 50 (chunks ending anywhere inside the rule's 64-token chunks); a second
    round reuses the freed state slots, resumes each prompt at its last block boundary from the prefix cache (a
    state snapshot) and gives the same tokens. (test_qwen3_next.py runs every budget in both scheduling modes on
    the same GDN layer.)"""
    _, _, refs = hf_refs
    llm = LLM(str(tiny_ckpt), block_size=8, max_num_batched_tokens=budget, async_scheduling=async_scheduling)
    for round_ in range(2):
        outs = _greedy(llm, [r[0] for r in refs])
        for (prompt, ref_tokens, _), out in zip(refs, outs):
            assert out.outputs[0].token_ids == ref_tokens
            assert out.num_cached_tokens == (0 if round_ == 0 else (len(prompt) - 1) // 8 * 8)
        _assert_all_blocks_free(llm)
        _assert_all_slots_free(llm)


def test_preemption_frees_state_slots(tiny_ckpt, hf_refs):
    """A KV cache far too small for the batch: requests are preempted and recomputed, transformers' tokens still,
    and every block and state slot is back in its pool at the end."""
    _, _, refs = hf_refs
    longest = max(len(r[0]) for r in refs) + MAX_NEW
    llm = LLM(str(tiny_ckpt), block_size=4, num_gpu_blocks_override=-(-longest // 4) + 2,
              max_model_len=longest + 4, max_num_batched_tokens=16, max_num_seqs=4)
    outs = _greedy(llm, [r[0] for r in refs] * 2)
    assert llm.engine.scheduler.num_preemptions_total > 0
    assert [o.outputs[0].token_ids for o in outs] == [r[1] for r in refs * 2]
    _assert_all_blocks_free(llm)
    _assert_all_slots_free(llm)


def test_shared_prefix_caching(tiny_ckpt):
    """Hybrid prefix caching (test_qwen3_next_prefix_caching.py) on this family's layouts: prompts sharing 1 to 17
    blocks with a cached 150-token one resume from the state snapshotted at exactly that boundary and give
    transformers' tokens and distributions."""
    shared_prefix_parity(tiny_ckpt, Oracle(_hf_model(tiny_ckpt)))
