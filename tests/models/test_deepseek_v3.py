"""DeepSeek-V3 vs transformers on a tiny random checkpoint (fp32, CPU): the dense families' parity suite
(test_model_parity.py: greedy tokens through chunked prefill, prefix caching, preemption and async scheduling;
logits at every prefill and decode position) on ../shared/MODELS.md's tiny config without the V3.2 indexer (MLA
with YaRN (factor 40, mscale) and interleaved RoPE, a dense first layer, grouped sigmoid routing with a random
e_score_correction_bias and a shared expert), plus its loading and cache: per-expert tensors stacked, MTP layers
skipped, one latent row of kv_lora_rank + qk_rope_head_dim per token in the paged cache; and the variants
q_lora_rank=None (q_proj) and rope_interleave=False."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from checkpoints import make_deepseek_checkpoint
from gyrfalcon import LLM, SamplingParams
from gyrfalcon.cache_spec import MLALatentSpec
from gyrfalcon.layers.mla import MultiHeadLatentAttention
from gyrfalcon.layers.mlp import GatedMLP
from gyrfalcon.layers.moe import SparseMoE
from gyrfalcon.models.deepseek_v3 import DeepseekV3ForCausalLM
from test_model_parity import (  # noqa: F401  (the shared suite, run here on this family's checkpoint)
    PROMPTS, _greedy, hf_refs, test_decode_logits_parity, family_greedy_parity as test_greedy_parity,
    family_greedy_parity_under_preemption as test_greedy_parity_under_preemption, test_prefill_logits_parity,
    test_prompts_span_several_blocks)
from test_model_parity import test_greedy_parity as _suite_greedy_parity


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    return make_deepseek_checkpoint(tmp_path_factory.mktemp("deepseek_v3"))


def test_checkpoint_is_fully_random(tiny_ckpt):
    sd = load_file(str(next(tiny_ckpt.glob("*.safetensors"))))
    for name, t in sd.items():
        assert t.unique().numel() > 1, name  # no constant tensor (zeros / ones) left from the init
    assert sd["model.layers.1.mlp.gate.e_score_correction_bias"].abs().min() > 0
    assert "model.layers.2.self_attn.kv_a_layernorm.weight" in sd and "model.layers.2.mlp.experts.7.up_proj.weight" in sd


def test_loading_and_latent_cache(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), block_size=8)
    runner = llm.engine.runner
    layers = runner.model.model.layers
    assert [type(layer.mlp) for layer in layers] == [GatedMLP, SparseMoE, SparseMoE]
    sd = load_file(str(next(tiny_ckpt.glob("*.safetensors"))))
    moe = layers[2].mlp
    for e in (0, 7):
        p = f"model.layers.2.mlp.experts.{e}."
        torch.testing.assert_close(moe.experts.w13[e], torch.cat([sd[p + "gate_proj.weight"],
                                                                  sd[p + "up_proj.weight"]]), rtol=0, atol=0)
        torch.testing.assert_close(moe.experts.w2[e], sd[p + "down_proj.weight"], rtol=0, atol=0)
    torch.testing.assert_close(moe.gate.e_score_correction_bias, sd["model.layers.2.mlp.gate.e_score_correction_bias"],
                               rtol=0, atol=0)
    assert (moe.gate.n_group, moe.gate.topk_group, moe.gate.routed_scaling_factor) == (4, 2, 2.5)
    shared = moe.shared_experts.gate_up_proj.weight
    torch.testing.assert_close(shared, torch.cat([sd["model.layers.2.mlp.shared_experts.gate_proj.weight"],
                                                  sd["model.layers.2.mlp.shared_experts.up_proj.weight"]]),
                               rtol=0, atol=0)
    attn = layers[1].self_attn
    assert isinstance(attn, MultiHeadLatentAttention)
    # One RoPE table for every layer; the softmax scale carries YaRN's mscale(40, 1)^2.
    assert all(layer.self_attn.rotary_emb is attn.rotary_emb for layer in layers)
    assert attn.rotary_emb.rotary_dim == 8 and not attn.rotary_emb.is_neox
    mscale = 0.1 * torch.log(torch.tensor(40.0)).item() + 1
    assert attn.scale == pytest.approx(24 ** -0.5 * mscale ** 2, rel=1e-6)
    # The paged cache: one row of kv_lora_rank + qk_rope_head_dim per token and layer, nothing else.
    specs = runner.model.kv_cache_specs("float32")
    assert specs == {i: MLALatentSpec(16, 8, "float32") for i in range(3)}
    cache = runner.kv_caches[0]
    assert isinstance(cache, torch.Tensor) and cache.shape[1:] == (8, 1, 24)


def test_latent_cache_holds_normed_latent_and_roped_k(tiny_ckpt):
    """After a prompt, the cache rows are [kv_a_layernorm(latent) | RoPE(k_rope)] as transformers computes them
    (its DynamicCache keeps exactly these, compressed): the cache is MLA's, not expanded heads."""
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_ckpt), dtype=torch.float32).eval()
    llm = LLM(str(tiny_ckpt), block_size=8, enable_prefix_caching=False, num_gpu_blocks_override=6,
              max_model_len=48)
    prompt = list(range(3, 22))
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1), use_tqdm=False)
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
    layer = out.cache.layers[1]
    latent, k_rope = layer.keys[0, 0], layer.values[0, 0]  # [S, 16], [S, 8]: transformers' de-interleaved rope
    rows = llm.engine.runner.kv_caches[1].flatten(0, 1)[:, 0]  # [6 blocks x 8, 24]
    # The freed blocks keep their rows; find the prompt's by its latent (blocks may be in any order).
    got = torch.stack([rows[(rows[:, :16] - latent[j]).abs().sum(-1).argmin()] for j in range(len(prompt))])
    torch.testing.assert_close(got[:, :16], latent, rtol=1e-5, atol=1e-5)
    # gyrfalcon rotates the interleaved pairs in place; transformers writes evens then odds.
    torch.testing.assert_close(torch.cat([got[:, 16::2], got[:, 17::2]], dim=-1), k_rope, rtol=1e-5, atol=1e-5)


def test_unfused_path_parity(tiny_ckpt, hf_refs, monkeypatch):
    """GYRFALCON_DISABLE_FUSION=1 (the fused-vs-unfused baseline): MLA's separate-op prep, no norm folded into the
    dense MLP, the same tokens as transformers."""
    monkeypatch.setenv("GYRFALCON_DISABLE_FUSION", "1")
    _, _, refs = hf_refs
    llm = LLM(str(tiny_ckpt), block_size=8, max_num_batched_tokens=16)
    assert not any(layer.self_attn.fused for layer in llm.engine.runner.model.model.layers)
    mlp = llm.engine.runner.model.model.layers[0].mlp
    assert not mlp.gate_up_in.folded and mlp.gate_up_in.plan(1) == "separate"
    outs = _greedy(llm, [r[0] for r in refs])
    assert [o.outputs[0].token_ids for o in outs] == [r[1] for r in refs]


def test_mtp_layers_skipped(tiny_ckpt):
    """Released checkpoints carry the multi-token-prediction module as layer num_hidden_layers: not loaded."""
    sd = load_file(str(next(tiny_ckpt.glob("*.safetensors"))))
    extra = {k.replace("model.layers.2.", "model.layers.3."): v for k, v in sd.items() if k.startswith("model.layers.2.")}
    extra["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    model = DeepseekV3ForCausalLM(AutoConfig.from_pretrained(str(tiny_ckpt)), max_position=64)
    loaded = model.load_weights(list(sd.items()) + list(extra.items()))
    assert loaded == model.expected_weights()
    assert not any("layers.3." in n for n in loaded)


def _prefill_logits_match(ckpt, tol=1e-5):
    """Prompt logprobs at every position and greedy tokens: gyrfalcon (chunked, 7-token budget) vs transformers."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpt))
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    llm = LLM(str(ckpt), block_size=8, max_num_batched_tokens=7)
    prompts = [tok(p).input_ids for p in PROMPTS[:3]]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for p, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(p):].tolist()
        with torch.no_grad():
            lp = hf(torch.tensor([p])).logits[0].float().log_softmax(-1)
        for pos in range(1, len(p)):
            got = out.prompt_logprobs[pos][p[pos]].logprob
            assert got == pytest.approx(lp[pos - 1, p[pos]].item(), abs=tol, rel=tol)


@pytest.mark.parametrize("variant", [dict(q_lora_rank=None), dict(rope_interleave=False)],
                         ids=["q_proj", "rotate_half"])
def test_variants_match_transformers(tmp_path, variant):
    ckpt = make_deepseek_checkpoint(tmp_path, seed=3, **variant)
    if variant.get("q_lora_rank", 0) is None:
        sd = load_file(str(next(ckpt.glob("*.safetensors"))))
        assert "model.layers.0.self_attn.q_proj.weight" in sd and not any("q_a_proj" in n for n in sd)
    _prefill_logits_match(ckpt)


def kernel_path_refs(model, refs, prefix_len, max_new):
    """The prompts the interpreted kernels run (their cost grows with the tokens): the two short prompts and the
    first prefix_len tokens of the long one (chunks of a 16-token budget over a growing cached prefix), with
    transformers' greedy tokens and logits for that prefix."""
    prompt = refs[2][0][:prefix_len]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return refs[:2] + [(prompt, out.sequences[0, len(prompt):].tolist(), torch.stack(out.logits, 0)[:, 0].float())]


def _triton_prep(monkeypatch, mla_layer, calls):
    """Routes the MLA layer's fused prep through the Triton kernels (on CPU tensors, under the interpreter),
    counting launches into calls["kv_prep"] / calls["q_prep"] / calls["v_proj"]."""
    from gyrfalcon.kernels.mla_prep import mla_kv_prep_triton, mla_q_prep_triton, mla_v_proj_triton

    def v_proj(*args):
        calls["v_proj"] += 1
        return mla_v_proj_triton(*args)

    def kv_prep(*args):
        calls["kv_prep"] += 1
        return mla_kv_prep_triton(*args)

    def q_prep(*args):
        calls["q_prep"] += 1
        return mla_q_prep_triton(*args)

    monkeypatch.setattr(mla_layer, "mla_kv_prep", kv_prep)
    monkeypatch.setattr(mla_layer, "mla_q_prep", q_prep)
    monkeypatch.setattr(mla_layer, "mla_v_proj", v_proj)


@pytest.fixture
def expanded_prefill(monkeypatch):
    """Every MLA layer attends its prefill steps in the expanded form (layers/mla_expanded.py; the tiny dims would
    pick the absorbed one), its context expanded in rounds of at most the step's tokens (a chunk over a longer
    prefix: several rounds merged). -> calls["expanded"]: the expanded attention launches."""
    import gyrfalcon.layers.mla_expanded as mla_expanded

    calls = {"expanded": 0}
    real = mla_expanded.mla_prefill_expanded

    def counted(*args):
        calls["expanded"] += 1
        return real(*args)

    monkeypatch.setattr(mla_expanded, "mla_prefill_expanded", counted)
    monkeypatch.setattr(mla_expanded, "MIN_WORKSPACE_ROWS", 1)
    monkeypatch.setattr(MultiHeadLatentAttention, "prefill_form", "expanded")
    return calls


def test_expanded_prefill_matches_transformers(tiny_ckpt, expanded_prefill):
    """The expanded form on the reference path: prompt logprobs at every position within 1e-5 and greedy tokens
    equal to transformers', prompts in 7-token chunks (later chunks over a cached prefix, in several rounds)."""
    _prefill_logits_match(tiny_ckpt)
    assert expanded_prefill["expanded"] > 0


def test_expanded_prefill_unfused(tiny_ckpt, expanded_prefill, monkeypatch):
    """The expanded form after the separate-op prep (GYRFALCON_DISABLE_FUSION=1): the same logits and tokens."""
    monkeypatch.setenv("GYRFALCON_DISABLE_FUSION", "1")
    _prefill_logits_match(tiny_ckpt)
    assert expanded_prefill["expanded"] > 0


def test_expanded_prefill_with_prefix_caching(tiny_ckpt, hf_refs, expanded_prefill):
    """The expanded form through prefix-cache hits and chunked prefill with async scheduling: transformers'
    greedy tokens (test_model_parity's suite)."""
    _suite_greedy_parity(tiny_ckpt, hf_refs, True, 7, True)
    assert expanded_prefill["expanded"] > 0


@pytest.mark.parametrize("form", ["absorbed", "expanded"])
def test_gpu_kernels_in_the_model(tiny_ckpt, hf_refs, monkeypatch, form):
    """The GPU path's MLA kernels (the fused kv / q prep and V projection launches, the Triton split-K kernel for
    decode rows and, for prefill steps, the tiled absorbed kernel or the expanded one, under the interpreter here)
    in place of the references inside the model: the same tokens and logprobs as transformers at every decode
    step, the first from a chunked prefill."""
    from gyrfalcon.kernels.common import HAS_TRITON

    if not HAS_TRITON:
        pytest.skip("triton (or its interpreter) is not available")
    import gyrfalcon.layers.mla as mla_layer
    import gyrfalcon.layers.mla_expanded as mla_expanded
    from gyrfalcon.kernels.mla_attention import (mla_decode_triton, mla_prefill_expanded_triton,
                                                 mla_prefill_tiled_triton)

    calls = {"decode": 0, "prefill": 0, "kv_prep": 0, "q_prep": 0, "v_proj": 0}
    if form == "expanded":
        del calls["prefill"]  # every prefill step takes the expanded kernel
        calls["expanded"] = 0

        def expanded(*args):
            calls["expanded"] += 1
            return mla_prefill_expanded_triton(*args)

        monkeypatch.setattr(mla_expanded, "mla_prefill_expanded", expanded)
        monkeypatch.setattr(mla_expanded, "MIN_WORKSPACE_ROWS", 1)
    monkeypatch.setattr(MultiHeadLatentAttention, "prefill_form", form)

    def triton_attention(q, cache, bt, sl, qsl, scale, L, is_decode=False, num_splits=None, indices=None):
        assert indices is None  # V3: dense MLA
        assert is_decode or form == "absorbed"
        calls["decode" if is_decode else "prefill"] += 1
        if is_decode:
            return mla_decode_triton(q, cache, bt, sl, scale, L, num_splits)
        return mla_prefill_tiled_triton(q, cache, bt, sl, qsl, scale, L)

    monkeypatch.setattr(mla_layer, "mla_attention", triton_attention)
    _triton_prep(monkeypatch, mla_layer, calls)
    _, model, refs = hf_refs
    vocab = model.config.vocab_size
    refs = kernel_path_refs(model, refs, 32, 8)
    llm = LLM(str(tiny_ckpt), block_size=8, max_num_batched_tokens=16)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=vocab)
    outs = llm.generate([{"prompt_token_ids": r[0]} for r in refs], sp, use_tqdm=False)
    assert all(calls.values()), calls
    for out, (_, ref_tokens, ref_logits) in zip(outs, refs):
        assert out.outputs[0].token_ids == ref_tokens[:8]
        for step, entry in enumerate(out.outputs[0].logprobs):
            got = torch.tensor([entry[t].logprob for t in range(vocab)])
            torch.testing.assert_close(got, ref_logits[step].log_softmax(-1), rtol=1e-5, atol=1e-5)


def test_prefill_form_rule_at_the_real_dims():
    """layers/mla_expanded.py's FLOP rule at DeepSeek-V3's dims (L 512, nope 128, rope 64, v 128): an 8k prompt takes
    the expanded form (~3.2x fewer FLOPs, kernels/mla_attention/expanded.py's arithmetic), one query over an 8k
    context (a decode row) and a 100-token chunk over it keep the absorbed form, a 1,000-token chunk over it expands."""
    import numpy as np

    from gyrfalcon.layers.mla_expanded import ExpandedPrefillPlan

    def ratio(q_lens, seq_lens):
        absorbed, expanded = ExpandedPrefillPlan(np.array(q_lens), np.array(seq_lens)).flops(512, 128, 64, 128)
        return absorbed / expanded

    assert 3.0 < ratio([8192], [8192]) < 3.3
    assert ratio([1], [8192]) < 1 and ratio([100], [8292]) < 1
    assert ratio([1000], [9192]) > 1
    assert ratio([8192, 1, 1], [8192, 4096, 4096]) > 1  # a mixed step's decode rows ride along
