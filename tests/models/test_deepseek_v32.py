"""DeepSeek-V3.2 (DeepSeek sparse attention) vs transformers on tiny random checkpoints (fp32, CPU).

The parity suite (test_model_parity.py: greedy tokens through chunked prefill, prefix caching, preemption and async
scheduling; logits at every prefill and decode position) runs on two checkpoints of ../shared/MODELS.md's tiny
DeepseekV32Config: "topk_covers" (index_topk 256, above every sequence here: the selection is every causal key, so
sparse MLA must equal dense MLA) and "sparse16" (index_topk 4 with 16 index heads: each query attends over 4 keys;
16 heads leave no exact ties in the relu'd scores, so transformers' cached and uncached runs agree and greedy must
match end to end). With the tiny config's 4 index heads ~1/16 of the keys score exactly 0 and the top-k is only
defined up to ties, so there the indexer is checked on its own: its scores before top-k against transformers'
(caught at its topk call), the selected sets equal up to ties, and the whole model given transformers' selection
equal to transformers' logits."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from checkpoints import make_deepseek_v32_checkpoint, step_row
from gyrfalcon import LLM, SamplingParams
from gyrfalcon.cache_spec import IndexerKeySpec, MLALatentSpec, SparseMLASpec
from gyrfalcon.engine.request import Request
from gyrfalcon.forward_context import forward_context
from gyrfalcon.kernels.dsa_indexer import indexer_scores, select_topk
from gyrfalcon.layers.dsa_indexer import LightningIndexer
from gyrfalcon.layers.mlp import GatedMLP
from gyrfalcon.layers.moe import SparseMoE
from gyrfalcon.models.deepseek_v3 import DeepseekV32ForCausalLM
from gyrfalcon.runner.forward_batch import build_forward_batch
from test_deepseek_v3 import _triton_prep, expanded_prefill, kernel_path_refs  # noqa: F401  (a fixture)
from test_model_parity import (  # noqa: F401  (the shared suite, run here on this family's checkpoints)
    PROMPTS, MAX_NEW, _greedy, hf_refs, test_decode_logits_parity, family_greedy_parity as test_greedy_parity,
    family_greedy_parity_under_preemption as test_greedy_parity_under_preemption, test_prefill_logits_parity,
    test_prompts_span_several_blocks)
from test_model_parity import test_greedy_parity as _suite_greedy_parity

VARIANTS = {"topk_covers": dict(index_topk=256), "sparse16": dict(index_topk=4, index_n_heads=16)}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def tiny_ckpt(request, tmp_path_factory):
    return make_deepseek_v32_checkpoint(tmp_path_factory.mktemp(f"deepseek_v32_{request.param}"),
                                        **VARIANTS[request.param])


@pytest.fixture(scope="module")
def ties_ckpt(tmp_path_factory):
    """The tiny config as MODELS.md gives it: 4 index heads, index_topk 4 (ties in the scores)."""
    return make_deepseek_v32_checkpoint(tmp_path_factory.mktemp("deepseek_v32_ties"), seed=1)


def test_topk_is_below_the_sequences(tiny_ckpt, hf_refs):
    """The sparse16 checkpoint's selection is a real choice (far fewer keys than each sequence has); topk_covers'
    is every key."""
    _, model, refs = hf_refs
    longest = max(len(r[0]) for r in refs) + MAX_NEW
    topk = model.config.index_topk
    assert topk >= longest if topk > 4 else 8 * topk < longest


def test_checkpoint_and_loading(ties_ckpt):
    sd = load_file(str(next(ties_ckpt.glob("*.safetensors"))))
    for name, t in sd.items():
        assert t.unique().numel() > 1, name  # no constant tensor left from the init (the LayerNorm bias included)
    ix = "model.layers.2.self_attn.indexer."
    names = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")
    assert {ix + n for n in names} <= set(sd)
    llm = LLM(str(ties_ckpt), block_size=8)
    runner = llm.engine.runner
    model = runner.model
    assert isinstance(model, DeepseekV32ForCausalLM)
    layers = model.model.layers
    assert [type(layer.mlp) for layer in layers] == [GatedMLP, SparseMoE, SparseMoE]
    indexer = layers[2].self_attn.indexer
    assert isinstance(indexer, LightningIndexer) and indexer.index_topk == 4 and indexer.rope_dim == 8
    assert indexer.weights_proj.weight.dtype == torch.float32
    for n in names[2:]:
        torch.testing.assert_close(indexer.get_submodule(n.rsplit(".", 1)[0]).get_parameter(n.rsplit(".", 1)[1]),
                                   sd[ix + n], rtol=0, atol=0)
    # wq_b and wk are shards of MLA's GEMMs: [wq_b | q_b_proj] on q_resid, [q_a_proj | wk | kv_a_proj_with_mqa] on x.
    attn, p = layers[2].self_attn, "model.layers.2.self_attn."
    want_q_b = torch.cat([sd[ix + "wq_b.weight"], sd[p + "q_b_proj.weight"]])
    torch.testing.assert_close(attn.fused_q_b_proj.weight, want_q_b, rtol=0, atol=0)
    torch.testing.assert_close(attn.fused_qkv_a_proj.weight, torch.cat([
        sd[p + "q_a_proj.weight"], sd[ix + "wk.weight"], sd[p + "kv_a_proj_with_mqa.weight"]]), rtol=0, atol=0)
    # One spec per layer: the MLA latent and the indexer keys, paged by the same block table.
    spec = SparseMLASpec(MLALatentSpec(16, 8, "float32"), IndexerKeySpec(16, "float32"))
    assert model.kv_cache_specs("float32") == {i: spec for i in range(3)}
    assert spec.page_bytes(8) == 8 * (24 + 16) * 4
    latent, keys = runner.kv_caches[1]
    assert latent.shape[1:] == (8, 1, 24) and keys.shape[1:] == (8, 1, 16) and latent.shape[0] == keys.shape[0]


def test_indexer_key_cache_holds_transformers_keys(ties_ckpt):
    """After a prompt, the indexer cache rows are transformers' indexer keys (LayerNorm(wk(x)), rotate_half RoPE on
    the first qk_rope dims) as its DynamicCache keeps them."""
    hf = AutoModelForCausalLM.from_pretrained(str(ties_ckpt), dtype=torch.float32).eval()
    llm = LLM(str(ties_ckpt), block_size=8, enable_prefix_caching=False, num_gpu_blocks_override=6,
              max_model_len=48)
    prompt = list(range(3, 22))
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1), use_tqdm=False)
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
    for layer in range(3):
        ref = out.cache.layers[layer].indexer_keys[0]  # [S, 16]
        rows = llm.engine.runner.kv_caches[layer][1].flatten(0, 1)[:, 0]  # [6 blocks x 8, 16]
        # The freed blocks keep their rows; find the prompt's (blocks may be in any order).
        got = torch.stack([rows[(rows - ref[j]).abs().sum(-1).argmin()] for j in range(len(prompt))])
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def _capture_transformers_indexer(hf, monkeypatch):
    """Per layer, what transformers' indexer saw and chose on the next forward: {layer: dict(x, q_resid, scores,
    indices)}; scores are the [S, T] matrix its forward hands to topk (masked: -inf or a large negative value)."""
    seen, active = {}, []
    real_topk = torch.Tensor.topk

    def topk(self, *args, **kwargs):
        if active:
            seen[active[-1]]["scores"] = self.detach().clone()[0]
        return real_topk(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "topk", topk)
    for i, layer in enumerate(hf.model.layers):
        def pre(module, args, i=i):
            seen[i] = dict(x=args[0][0].detach().clone(), q_resid=args[1][0].detach().clone())
            active.append(i)

        def post(module, args, out, i=i):
            active.pop()
            seen[i]["indices"] = out[0].long()

        layer.self_attn.indexer.register_forward_pre_hook(pre)
        layer.self_attn.indexer.register_forward_hook(post)
    return seen


def _prompt(ckpt, n=None):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(ckpt))(PROMPTS[2]).input_ids
    return ids[:n] if n else ids


def _assert_same_up_to_ties(ours, ref, scores, k, tol=1e-5):
    """ours, ref: selected positions per row (-1 / non-causal entries ignored); scores [S, T] the reference's. Every
    position chosen by one side only must score within tol of the row's k-th best (a tie at the cut)."""
    n_ties = 0
    for p in range(scores.shape[0]):
        a = {j for j in ours[p].tolist() if 0 <= j <= p}
        b = {j for j in ref[p].tolist() if 0 <= j <= p}
        assert len(a) == len(b) == min(k, p + 1), p
        if a == b:
            continue
        cut = scores[p, :p + 1].topk(min(k, p + 1)).values[-1]
        for j in a ^ b:
            assert abs(scores[p, j] - cut) <= tol * max(1.0, abs(cut)), (p, j, scores[p, j].item(), cut.item())
        n_ties += 1
    return n_ties


def test_indexer_scores_and_selection_match_transformers(ties_ckpt, monkeypatch):
    """Every layer's indexer, fed transformers' inputs (the layer's normed hidden states and q_lora residual): the
    scores before top-k equal transformers' at every causal (query, key) within 1e-5 (-inf past the query), computed
    over a paged key cache of shuffled blocks in two chunks; the top-k sets equal transformers' up to ties."""
    hf = AutoModelForCausalLM.from_pretrained(str(ties_ckpt), dtype=torch.float32).eval()
    seen = _capture_transformers_indexer(hf, monkeypatch)
    prompt = _prompt(ties_ckpt)
    S = len(prompt)
    with torch.no_grad():
        hf(torch.tensor([prompt]))
    monkeypatch.undo()
    model = LLM(str(ties_ckpt), block_size=8).engine.runner.model
    block_size, n_blocks = 4, -(-S // 4)
    perm = torch.randperm(n_blocks + 3)
    bt = perm[:n_blocks].to(torch.int32)[None]
    positions = torch.arange(S)
    slots = (bt[0].long()[positions // block_size] * block_size + positions % block_size)
    causal = positions[None, :] <= positions[:, None]
    total_ties = 0
    for layer, ref in seen.items():
        cache = torch.full((n_blocks + 3, block_size, 1, 16), float("nan"))
        with torch.no_grad():
            q, k, w = model.model.layers[layer].self_attn.indexer_projections(positions, ref["x"], ref["q_resid"])
        cache.view(-1, 16)[slots] = k
        got = []
        for lo, hi in ((0, S // 2), (S // 2, S)):  # a first chunk, then the rest over the cached prefix
            qsl = torch.tensor([0, hi - lo], dtype=torch.int32)
            got.append(indexer_scores(q[lo:hi], w[lo:hi], cache, bt, torch.tensor([hi], dtype=torch.int32), qsl))
        got = torch.cat(got)[:, :S]
        ref_scores = ref["scores"]
        assert ref_scores.shape == (S, S)
        torch.testing.assert_close(got[causal], ref_scores[causal], rtol=1e-5, atol=1e-5)
        assert torch.isneginf(got[~causal]).all()
        assert (ref_scores[causal] == 0).any()  # exact ties exist here: sets are compared up to them
        total_ties += _assert_same_up_to_ties(select_topk(got, 4), ref["indices"], ref_scores, 4)
    assert total_ties < len(seen) * S // 4  # ties at the cut are the exception, not the rule


def test_model_with_transformers_selection_matches(ties_ckpt, monkeypatch):
    """The sparse attention itself: gyrfalcon's model, handed transformers' top-k per layer (its own indexer still
    writing the key cache), gives transformers' logits at every prompt position, the prompt run in two chunks
    over the paged cache."""
    import gyrfalcon.layers.dsa_indexer as dsa_layer

    hf = AutoModelForCausalLM.from_pretrained(str(ties_ckpt), dtype=torch.float32).eval()
    seen = _capture_transformers_indexer(hf, monkeypatch)
    prompt = _prompt(ties_ckpt)
    with torch.no_grad():
        ref_logits = hf(torch.tensor([prompt])).logits[0]
    monkeypatch.undo()
    calls = []

    def given_selection(q, w, cache, bt, seq_lens, qsl, index_topk):
        layer = len(calls) % len(seen)
        end = int(seq_lens[0])
        start = end - int(qsl[1] - qsl[0])
        calls.append(layer)
        return seen[layer]["indices"][start:end].to(torch.int32)

    monkeypatch.setattr(dsa_layer, "indexer_topk", given_selection)
    llm = LLM(str(ties_ckpt), block_size=8)
    torch.testing.assert_close(_prefill_in_two_chunks(llm, prompt), ref_logits, rtol=1e-5, atol=1e-5)
    assert len(calls) == 2 * len(seen)
    # The test can tell: attending over every causal key instead (no selection) gives other logits.
    monkeypatch.setattr(dsa_layer, "indexer_topk", lambda *args: None)
    assert (_prefill_in_two_chunks(llm, prompt) - ref_logits).abs().max() > 1e-2


def _prefill_in_two_chunks(llm, prompt):
    """Logits [S, vocab] at every position of `prompt`, run as two prefill chunks of one request (freed after)."""
    runner, bm = llm.engine.runner, llm.engine.block_manager
    req = Request("0", prompt, SamplingParams(max_tokens=1))
    assert bm.allocate_slots(req, req.num_tokens)
    got = []
    for n in (len(prompt) // 2, len(prompt) - len(prompt) // 2):
        fb = build_forward_batch([step_row(req, n, True, req.num_computed_tokens)], runner.block_size, runner.device)
        with torch.inference_mode(), forward_context(fb, runner.kv_caches):
            got.append(runner.model.compute_logits(runner.model(fb.input_ids, fb.positions)))
        req.num_computed_tokens += n
    bm.free(req)
    return torch.cat(got)


def test_indexer_path_with_topk_covering_equals_dense(tiny_ckpt, hf_refs, monkeypatch):
    """With index_topk >= the context the layer skips the scores (every key is selected); forced through the
    indexer and the sparse attention anyway, the logprobs still match transformers' at every decode step."""
    _, model, refs = hf_refs
    if model.config.index_topk <= 4:
        pytest.skip("covers the topk_covers checkpoint")
    calls = []
    real = LightningIndexer.select

    def forced(self, q, w, key_cache, fb):
        out = real(self, q, w, key_cache, fb)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(LightningIndexer, "every_key_selected", lambda self, fb, key_cache: False)
    monkeypatch.setattr(LightningIndexer, "select", forced)
    vocab = model.config.vocab_size
    llm = LLM(str(tiny_ckpt), block_size=8, max_num_batched_tokens=16)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=vocab)
    outs = llm.generate([{"prompt_token_ids": r[0]} for r in refs[:3]], sp, use_tqdm=False)
    assert calls and all(calls)
    for out, (_, ref_tokens, ref_logits) in zip(outs, refs):
        assert out.outputs[0].token_ids == ref_tokens[:8]
        for step, entry in enumerate(out.outputs[0].logprobs):
            got = torch.tensor([entry[t].logprob for t in range(vocab)])
            torch.testing.assert_close(got, ref_logits[step].log_softmax(-1), rtol=1e-5, atol=1e-5)


def test_gpu_kernels_in_the_model(tiny_ckpt, hf_refs, monkeypatch):
    """The GPU path's kernels (under the interpreter here) in place of the references inside the sparse model: the
    fused kv / q prep launches (the indexer key's LayerNorm + RoPE + cache write, the index query's RoPE and weight
    scale included), the Triton indexer scores + top-k and the split-K MLA kernel reading each row's selected keys
    (decode rows and per-token prefill rows): transformers' tokens and logprobs at every decode step, the first from
    a chunked prefill."""
    from gyrfalcon.kernels.common import HAS_TRITON

    if not HAS_TRITON:
        pytest.skip("triton (or its interpreter) is not available")
    _, model, refs = hf_refs
    if model.config.index_topk > 4:
        pytest.skip("covers the sparse16 checkpoint")
    import gyrfalcon.layers.dsa_indexer as dsa_layer
    import gyrfalcon.layers.mla as mla_layer
    from gyrfalcon.kernels.dsa_indexer import indexer_topk_triton
    from gyrfalcon.kernels.mla_attention import mla_decode_triton, mla_prefill_triton

    calls = {"decode": 0, "prefill": 0, "indexer": 0, "kv_prep": 0, "q_prep": 0, "v_proj": 0}
    dense = mla_layer.mla_attention  # steps whose sequences all fit in index_topk keys (V3's test covers them)

    def triton_attention(q, cache, bt, sl, qsl, scale, L, is_decode=False, num_splits=None, indices=None):
        if indices is None:
            return dense(q, cache, bt, sl, qsl, scale, L, is_decode, num_splits)
        calls["decode" if is_decode else "prefill"] += 1
        if is_decode:
            return mla_decode_triton(q, cache, bt, sl, scale, L, num_splits, indices=indices)
        return mla_prefill_triton(q, cache, bt, sl, qsl, scale, L, indices=indices)

    def triton_topk(*args):
        calls["indexer"] += 1
        return indexer_topk_triton(*args)

    monkeypatch.setattr(mla_layer, "mla_attention", triton_attention)
    monkeypatch.setattr(dsa_layer, "indexer_topk", triton_topk)
    _triton_prep(monkeypatch, mla_layer, calls)
    vocab = model.config.vocab_size
    refs = kernel_path_refs(model, refs, 24, 6)  # the second chunk over a cached prefix longer than index_topk
    llm = LLM(str(tiny_ckpt), block_size=8, max_num_batched_tokens=16)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=vocab)
    outs = llm.generate([{"prompt_token_ids": r[0]} for r in refs], sp, use_tqdm=False)
    assert all(calls.values()), calls
    for out, (_, ref_tokens, ref_logits) in zip(outs, refs):
        assert out.outputs[0].token_ids == ref_tokens[:6]
        for step, entry in enumerate(out.outputs[0].logprobs):
            got = torch.tensor([entry[t].logprob for t in range(vocab)])
            torch.testing.assert_close(got, ref_logits[step].log_softmax(-1), rtol=1e-5, atol=1e-5)


def test_unfused_path_parity(tiny_ckpt, hf_refs, monkeypatch):
    """GYRFALCON_DISABLE_FUSION=1 (the fused-vs-unfused baseline): the indexer's and MLA's separate-op prep (its
    own LayerNorm, RoPE, weight scale and key store), the same tokens as transformers."""
    monkeypatch.setenv("GYRFALCON_DISABLE_FUSION", "1")
    _, _, refs = hf_refs
    llm = LLM(str(tiny_ckpt), block_size=8, max_num_batched_tokens=16)
    assert not any(layer.self_attn.fused for layer in llm.engine.runner.model.model.layers)
    outs = _greedy(llm, [r[0] for r in refs])
    assert [o.outputs[0].token_ids for o in outs] == [r[1] for r in refs]


def test_expanded_prefill_parity(tiny_ckpt, hf_refs, expanded_prefill):  # noqa: F811
    """Prefill steps asked for the expanded form (layers/mla_expanded.py): dense steps take it (topk_covers: every
    prefill step), steps with a sparse selection keep the absorbed sparse path (sparse16: every prefill step here
    runs over more than 4 keys); transformers' greedy tokens through 7-token chunks over cached prefixes and
    prefix-cache hits."""
    _suite_greedy_parity(tiny_ckpt, hf_refs, True, 7, False)
    _, model, _ = hf_refs
    assert (expanded_prefill["expanded"] > 0) == (model.config.index_topk > 4), expanded_prefill
