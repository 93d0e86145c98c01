"""EAGLE-3 drafts: the target's aux hidden states are transformers' hidden_states[k]; the three public layouts load
the same head; the draft's proposals, step after step through the engine (its own cache, rejected positions
rewritten), equal those of a reference head built from transformers' decoder layers over the whole sequence; and
greedy outputs with a random head equal transformers' (Llama, Qwen3, k = 1..3, with the engine's features)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from checkpoints import make_checkpoint
from eagle3_checkpoints import make_eagle3_draft
from gyrfalcon import LLM, SamplingParams
from gyrfalcon.models.eagle3 import load_eagle3_draft
from test_model_parity import hf_refs  # noqa: F401
from test_model_parity import test_greedy_parity as greedy_parity
from test_model_parity import test_greedy_parity_under_preemption as greedy_parity_under_preemption
from spec_testutil import record_drafts

PROMPTS = [[5, 9, 13, 2, 7, 5, 9, 13], [11, 4, 4, 8, 30, 6, 1, 3, 17], [21, 3]]


@pytest.fixture(scope="module")
def deep_llama(tmp_path_factory):
    """A 4-layer Llama target: room for three distinct aux layers below the last."""
    return make_checkpoint(tmp_path_factory.mktemp("llama4"), "llama", num_hidden_layers=4)


def _spec(draft, k, **kw):
    return {"speculative_config": {"method": "eagle3", "model": str(draft), "num_speculative_tokens": k, **kw}}


def test_aux_hidden_states_are_transformers_hidden_states(deep_llama):
    """Layer id k: the residual stream entering layer k (0: the embedding output) = transformers' hidden_states[k]."""
    llm = LLM(str(deep_llama), device="cpu", block_size=4)
    inner = llm.engine.runner.model.model
    inner.aux_hidden_layers = (0, 1, 3)
    prompt = PROMPTS[1]
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    got = inner.aux_hidden
    hf = AutoModelForCausalLM.from_pretrained(str(deep_llama), dtype=torch.float32).eval()
    with torch.no_grad():
        hs = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    want = torch.cat([hs[0][0], hs[1][0], hs[3][0]], dim=-1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_three_layouts_load_the_same_head(deep_llama, tmp_path):
    """One seed written as the original EAGLE release, SpecForge and speculators: the same parameters and d2t; aux
    layer ids in gyrfalcon's meaning (SpecForge's counted one less)."""
    target = LLM(str(deep_llama), device="cpu", block_size=4).engine.runner.model
    drafts = {}
    for fmt in ("eagle", "specforge", "speculators"):
        opts = {"norm_before_residual": False} if fmt == "speculators" else {}
        path = make_eagle3_draft(tmp_path / fmt, deep_llama, fmt, aux_ids=[1, 2, 3], **opts)
        drafts[fmt] = load_eagle3_draft(str(path), None, target, "cpu", torch.float32, layer_idx=4)
    assert drafts["eagle"].spec.aux_layer_ids is None
    assert drafts["specforge"].spec.aux_layer_ids == [1, 2, 3] == drafts["speculators"].spec.aux_layer_ids
    assert [d.spec.layer_prefix for d in drafts.values()] == ["midlayer.", "midlayer.", "layers.0."]
    ref = drafts["eagle"].state_dict()
    for fmt in ("specforge", "speculators"):
        sd = drafts[fmt].state_dict()
        assert sorted(sd) == sorted(ref)
        for name in ref:
            assert torch.equal(sd[name], ref[name]), (fmt, name)
    assert not torch.equal(drafts["eagle"].d2t, torch.zeros_like(drafts["eagle"].d2t))


def test_bad_drafts_are_refused_clearly(deep_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    target = LLM(str(deep_llama), device="cpu", block_size=4).engine.runner.model
    path = make_eagle3_draft(tmp_path / "d", deep_llama, "speculators", aux_ids=[1, 2, 3])
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["layers.0.mlp.up_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="misses.*up_proj"):
        load_eagle3_draft(str(path), None, target, "cpu", torch.float32, layer_idx=4)
    tensors["layers.0.mlp.up_proj.weight"] = torch.zeros(96, 64)
    tensors["layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="has no place"):
        load_eagle3_draft(str(path), None, target, "cpu", torch.float32, layer_idx=4)
    other = make_checkpoint(tmp_path / "small_vocab", "llama", vocab_size=300)
    path = make_eagle3_draft(tmp_path / "d2", other, "speculators", aux_ids=[0, 1, 2])
    with pytest.raises(ValueError, match="vocabulary of 300"):
        load_eagle3_draft(str(path), None, target, "cpu", torch.float32, layer_idx=4)
    # The default aux layers (2, N // 2, N - 3) need a deeper target than 4 layers.
    path = make_eagle3_draft(tmp_path / "d3", deep_llama, "eagle")
    with pytest.raises(ValueError, match="too few for the default EAGLE-3 aux layers"):
        LLM(str(deep_llama), device="cpu", block_size=4, **_spec(path, 2))


# ---- a reference head from transformers' layers ------------------------------------------------------
def _reference_drafts(draft, hf_target, aux_ids, tokens, k, layer_type):
    """The k drafts after `tokens` (prompt + outputs so far), from scratch: transformers' decoder layer with q/k/v
    over 2H, the EAGLE-3 input split, and a DynamicCache for the k - 1 chained steps."""
    from transformers import DynamicCache, LlamaConfig, Qwen3Config
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    s = draft.spec
    kw = dict(hidden_size=s.hidden_size, num_attention_heads=s.num_heads, num_key_value_heads=s.num_kv_heads,
              head_dim=s.head_dim, intermediate_size=s.intermediate_size, rms_norm_eps=s.eps,
              max_position_embeddings=s.max_position, vocab_size=s.target_vocab_size)
    cfg = (Qwen3Config if layer_type == "qwen3" else LlamaConfig)(**kw)
    cfg._attn_implementation = "sdpa"
    layer = (Qwen3DecoderLayer if layer_type == "qwen3" else LlamaDecoderLayer)(cfg, 0).eval()
    H = s.hidden_size
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(layer.self_attn, name, torch.nn.Linear(2 * H, getattr(draft, name).out_features, bias=False))
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(layer.self_attn, name).weight.copy_(getattr(draft, name).weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(layer.mlp, name).weight.copy_(getattr(draft, name).weight)
        layer.input_layernorm.weight.copy_(draft.input_layernorm.weight)
        layer.post_attention_layernorm.weight.copy_(draft.post_attention_layernorm.weight)
        if layer_type == "qwen3":
            layer.self_attn.q_norm.weight.copy_(draft.q_norm.weight)
            layer.self_attn.k_norm.weight.copy_(draft.k_norm.weight)
    rope = LlamaRotaryEmbedding(cfg)

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + s.eps) * w

    def run(ids, hidden, pos, cache):
        e = hf_target.model.embed_tokens(ids)
        residual = hidden
        h = rms(hidden, draft.hidden_norm.weight)
        if s.norm_before_residual:
            residual = h
        x = torch.cat([layer.input_layernorm(e), h], dim=-1)[None]
        pe = rope(x, pos[None])
        a = layer.self_attn(hidden_states=x, position_embeddings=pe, attention_mask=None, past_key_values=cache)[0]
        x = residual[None] + a
        y = x + layer.mlp(layer.post_attention_layernorm(x))
        y = y[0]
        logits = torch.nn.functional.linear(rms(y, draft.norm.weight), draft.lm_head.weight)
        return y, logits[-1].argmax()

    with torch.no_grad():
        L = len(tokens)
        hs = hf_target(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
        aux = torch.cat([hs[i][0] for i in aux_ids], dim=-1)
        if draft.input_norm is not None:
            aux = rms(aux, draft.input_norm.weight)
        hidden = torch.nn.functional.linear(aux, draft.fc.weight)
        cache = DynamicCache(config=cfg)
        y, d = run(torch.tensor(tokens[1:]), hidden, torch.arange(L - 1), cache)
        out = [int(d + draft.d2t[d])]
        h = y[-1:]
        for j in range(1, k):
            y, d = run(torch.tensor([out[-1]]), h, torch.tensor([L - 2 + j]), cache)
            out.append(int(d + draft.d2t[d]))
            h = y[-1:]
    return out


@pytest.mark.parametrize("layer_type,options", [("llama", {"norm_before_residual": False}),
                                                ("qwen3", {"norm_before_residual": True, "norm_before_fc": True})],
                         ids=["llama-layer", "qwen3-layer-norms"])
def test_drafts_match_a_transformers_reference_head(deep_llama, tmp_path, layer_type, options):
    """Every step's drafts (after the prefill and after each verify step, rejected positions rewritten, chained
    passes in lookahead slots, a prefix-cache hit's positions from the cached blocks) equal the reference head's
    over the whole sequence so far."""
    k = 3
    path = make_eagle3_draft(tmp_path / "d", deep_llama, "speculators", aux_ids=[1, 2, 3], draft_vocab=300,
                             qk_norm=layer_type == "qwen3", **options)
    llm = LLM(str(deep_llama), device="cpu", block_size=4, max_num_batched_tokens=6, **_spec(path, k))
    seen = record_drafts(llm)
    # Twice: the second round starts from prefix-cache hits, whose blocks carry the draft's K/V too.
    for _ in range(2):
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=10,
                                                                                 ignore_eos=True), use_tqdm=False)
    assert llm.engine.block_manager.prefix_hits > 0
    hf = AutoModelForCausalLM.from_pretrained(str(deep_llama), dtype=torch.float32).eval()
    assert len(seen) >= 2 * 3 * 4
    for tokens, drafts in seen:
        assert drafts == _reference_drafts(llm.engine.runner.proposer.draft, hf, [1, 2, 3], tokens, k, layer_type), tokens


# ---- lossless greedy outputs ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def random_head(tiny_ckpt, tmp_path_factory):
    """A random speculators-layout head for the 2-layer tiny target (aux layers 0, 1, 2) over a draft vocabulary of
    200 of the target's 512 tokens (d2t): its drafts are nearly always rejected, the rollback path."""
    return make_eagle3_draft(tmp_path_factory.mktemp("head"), tiny_ckpt, "speculators", aux_ids=[0, 1, 2],
                             draft_vocab=200)


def _check_drafted(llm):
    s = llm.engine.spec_stats
    assert s.num_drafts > 0 and s.num_draft_tokens > 0


@pytest.mark.parametrize("k,prefix_caching,budget,async_scheduling", [
    (1, True, 7, True), (2, False, None, False), (3, True, None, False)],
    ids=["k1-prefix-chunked-async", "k2-plain-sync", "k3-prefix"])
def test_greedy_parity_with_eagle3(tiny_ckpt, hf_refs, random_head, k, prefix_caching, budget,  # noqa: F811
                                   async_scheduling):
    greedy_parity(tiny_ckpt, hf_refs, prefix_caching, budget, async_scheduling, llm_kw=_spec(random_head, k),
                  check=_check_drafted)


def test_greedy_parity_with_eagle3_under_preemption(tiny_ckpt, hf_refs, random_head):  # noqa: F811
    greedy_parity_under_preemption(tiny_ckpt, hf_refs, True, True, llm_kw=_spec(random_head, 2), check=_check_drafted)


def test_decode_and_verify_graphs_hand_the_draft_their_aux_states(qwen3_ckpt, tmp_path):
    """With the decode / verify graphs (on a CPU the padded step runs eagerly, through the same static inputs), the
    draft gets the first n * q rows of each step's aux hidden states: its drafts and the outputs are those of the
    eager path."""
    from gyrfalcon.runner.cuda_graph import CudaGraphRunner

    k = 2
    head = make_eagle3_draft(tmp_path / "head", qwen3_ckpt, "speculators", aux_ids=[0, 1, 2], draft_vocab=200)
    kw = dict(device="cpu", block_size=4, max_model_len=128, max_num_batched_tokens=64, max_num_seqs=6,
              **_spec(head, k))
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def run(graphs):
        llm = LLM(str(qwen3_ckpt), **kw)
        r = llm.engine.runner
        seen, drafts = [], []
        if graphs:
            r.graph_runner = CudaGraphRunner(r.model, r.kv_caches, 6, 128, r.block_size, r.device, r.last_sampled,
                                             query_lens=(1, 1 + k))
            forward = r.graph_runner._forward
            r.graph_runner._forward = lambda fb, src: seen.append(fb.uniform_query_len) or forward(fb, src)
        propose = r.proposer.propose

        def spy(rows, sampled):
            # One aux row per token of the step: a padded graph's extra rows are cut off.
            assert r.proposer.aux.shape[0] == sum(sr.num_new_tokens for sr in rows)
            drafts.append(propose(rows, sampled))
            return drafts[-1]
        r.proposer.propose = spy
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        return out, drafts, seen

    eager, eager_drafts, _ = run(False)
    graphed, graphed_drafts, seen = run(True)
    assert 1 + k in seen  # verify steps went through the graph runner (padded to a captured batch size)
    assert graphed == eager and graphed_drafts == eager_drafts
