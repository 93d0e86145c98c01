"""gyrfalcon vs Hugging Face transformers on tiny random checkpoints (fp32, CPU): greedy tokens
and logits, through every scheduling path (chunked prefill, prefix caching, preemption)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gyrfalcon import LLM, SamplingParams
from gyrfalcon.engine.request import Request
from checkpoints import step_row
from gyrfalcon.forward_context import forward_context
from gyrfalcon.runner.forward_batch import build_forward_batch

PROMPTS = [
    "def add(a, b):",
    "The capital of",
    "import os\nimport sys\n\n\ndef main(argv):\n    parser = make_parser()\n    args = parser.parse_args(argv)\n"
    "    for name in sorted(os.listdir(args.path)):\n        print(name)\n    return 0\n",
    "x",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
]
MAX_NEW = 24


@pytest.fixture(scope="module")
def hf_refs(tiny_ckpt):
    """transformers' greedy continuations and their per-step logits, per prompt."""
    return greedy_refs(tiny_ckpt, PROMPTS)


def greedy_refs(ckpt, prompts):
    """(tokenizer, transformers' fp32 model, [(prompt ids, greedy continuation of MAX_NEW tokens, per-step logits
    [MAX_NEW, V])] per prompt) for the checkpoint `ckpt`."""
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    refs = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        refs.append((ids[0].tolist(), out.sequences[0, ids.shape[1]:].tolist(),
                     torch.stack(out.logits, 0)[:, 0].float()))
    return tok, model, refs


def _greedy(llm, prompts, **kw):
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, **kw)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


def _assert_all_blocks_free(llm):
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(c == 0 for c in bm.ref_cnt)


def test_prompts_span_several_blocks(hf_refs):
    _, _, refs = hf_refs
    assert max(len(r[0]) for r in refs) > 4 * 8  # > 4 blocks of the block size used below


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("budget", [None, 7])
def test_greedy_parity(tiny_ckpt, hf_refs, prefix_caching, budget, async_scheduling, llm_kw=None,
                       check=None):
    """llm_kw: more LLM arguments, check(llm): more checks after the runs (tests/spec_decode: a speculative_config
    and its acceptance counters)."""
    _, _, refs = hf_refs
    llm = LLM(str(tiny_ckpt), block_size=8, enable_prefix_caching=prefix_caching,
              max_num_batched_tokens=budget, async_scheduling=async_scheduling, **(llm_kw or {}))
    outs = _greedy(llm, [r[0] for r in refs])
    for (prompt, ref_tokens, _), out in zip(refs, outs):
        assert out.outputs[0].token_ids == ref_tokens
        assert out.outputs[0].finish_reason == "length"
    _assert_all_blocks_free(llm)
    # A second round hits the prefix cache (when on) and must give the same tokens.
    outs2 = _greedy(llm, [r[0] for r in refs])
    assert [o.outputs[0].token_ids for o in outs2] == [r[1] for r in refs]
    if prefix_caching:
        assert llm.engine.block_manager.prefix_hits > 0
        assert any(o.num_cached_tokens > 0 for o in outs2)
    else:
        assert llm.engine.block_manager.prefix_hits == 0
    _assert_all_blocks_free(llm)
    if check is not None:
        check(llm)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_parity_under_preemption(tiny_ckpt, hf_refs, prefix_caching, async_scheduling, llm_kw=None,
                                        check=None):
    """A KV cache far too small for the batch: requests get preempted and recomputed, and still
    finish with exactly transformers' tokens."""
    _, _, refs = hf_refs
    longest = max(len(r[0]) for r in refs) + MAX_NEW
    blocks = -(-longest // 4) + 2
    llm = LLM(str(tiny_ckpt), block_size=4, num_gpu_blocks_override=blocks, max_model_len=longest + 4,
              enable_prefix_caching=prefix_caching, max_num_batched_tokens=16,
              async_scheduling=async_scheduling, **(llm_kw or {}))
    outs = _greedy(llm, [r[0] for r in refs] * 2)
    assert llm.engine.scheduler.num_preemptions_total > 0
    for out, (_, ref_tokens, _) in zip(outs, refs * 2):
        assert out.outputs[0].token_ids == ref_tokens
    _assert_all_blocks_free(llm)
    if check is not None:
        check(llm)


# The families beyond these dense ones import the two below under the shared names: the engine's features (prefix
# caching, chunked prefill, async scheduling, preemption) do not depend on the model and run in every combination
# here; each other family runs each of them at least once (its own layers through every kind of step), which keeps
# the suite's CPU time in bounds as families are added.
@pytest.mark.parametrize("prefix_caching,budget,async_scheduling", [(True, 7, True), (False, None, False)],
                         ids=["prefix-chunked-async", "plain-sync"])
def family_greedy_parity(tiny_ckpt, hf_refs, prefix_caching, budget, async_scheduling):
    test_greedy_parity(tiny_ckpt, hf_refs, prefix_caching, budget, async_scheduling)


@pytest.mark.parametrize("prefix_caching,async_scheduling", [(True, True)], ids=["prefix-async"])
def family_greedy_parity_under_preemption(tiny_ckpt, hf_refs, prefix_caching, async_scheduling):
    test_greedy_parity_under_preemption(tiny_ckpt, hf_refs, prefix_caching, async_scheduling)


def test_decode_logits_parity(tiny_ckpt, hf_refs):
    """Every step's full distribution (logprobs over the whole vocabulary) matches transformers'
    log_softmax(logits): the first from the prefill, the rest from decode steps."""
    _, model, refs = hf_refs
    vocab = model.config.vocab_size
    llm = LLM(str(tiny_ckpt), block_size=8, max_num_batched_tokens=16)
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=vocab)
    outs = llm.generate([{"prompt_token_ids": r[0]} for r in refs], sp, use_tqdm=False)
    for out, (_, ref_tokens, ref_logits) in zip(outs, refs):
        lps = out.outputs[0].logprobs
        assert len(lps) == MAX_NEW
        ref_lp = ref_logits.log_softmax(-1)
        for step, entry in enumerate(lps):
            got = torch.full((vocab,), float("nan"))
            for tid, lp in entry.items():
                got[tid] = lp.logprob
            torch.testing.assert_close(got, ref_lp[step], rtol=1e-5, atol=1e-5)
            assert entry[ref_tokens[step]].rank == 1


def test_prefill_logits_parity(tiny_ckpt, hf_refs):
    """Raw logits at every prompt position, several prompts in one ragged batch, in two chunks."""
    _, model, refs = hf_refs
    llm = LLM(str(tiny_ckpt), block_size=8)
    runner = llm.engine.runner
    bm = llm.engine.block_manager
    reqs = [Request(str(i), r[0], SamplingParams(max_tokens=1)) for i, r in enumerate(refs)]
    for req in reqs:
        assert bm.allocate_slots(req, req.num_tokens)
    got = {i: [] for i in range(len(reqs))}
    # Two steps: the first half of every prompt, then the rest reading the cached first half.
    for part in (0, 1):
        sched = []
        for req in reqs:
            half = req.num_tokens // 2
            n = half if part == 0 else req.num_tokens - half
            if n:
                sched.append(step_row(req, n, part == 1, req.num_computed_tokens))
        fb = build_forward_batch(sched, runner.block_size, runner.device)
        with torch.inference_mode(), forward_context(fb, runner.kv_caches):
            logits = runner.model.compute_logits(runner.model(fb.input_ids, fb.positions))
        qsl = fb.query_start_loc.tolist()
        for j, sr in enumerate(sched):
            got[int(sr.request.request_id)].append(logits[qsl[j]:qsl[j + 1]])
            sr.request.num_computed_tokens += sr.num_new_tokens
    for i, (prompt, _, _) in enumerate(refs):
        with torch.no_grad():
            ref = model(torch.tensor([prompt])).logits[0].float()
        torch.testing.assert_close(torch.cat(got[i]), ref, rtol=1e-5, atol=1e-5)
    for req in reqs:
        bm.free(req)


def _record_norm_calls(monkeypatch) -> list:
    """(rows, norm weight) of every RMSNorm the layers launch from now on (layers/norm.py's rms_norm wrapped)."""
    import gyrfalcon.layers.norm as norm_layer

    seen = []
    real = norm_layer.rms_norm
    monkeypatch.setattr(norm_layer, "rms_norm",
                        lambda x, w, *a, **k: seen.append((x.shape[0], w)) or real(x, w, *a, **k))
    return seen


def test_folded_norms_parity(tiny_ckpt, hf_refs, monkeypatch):
    """The default path: each layer's norm weights are folded into qkv / gate_up at load (fold_norms), batches
    of several rows run no layer norm at all (the residual add inside o_proj / down_proj, rstd in the qkv prep
    and SiLU-and-mul) and single rows run the norm inside the GEMV, with the folded weights: the same tokens and
    logprobs as transformers (random norm weights)."""
    from safetensors.torch import load_file

    _, model, refs = hf_refs
    llm = LLM(str(tiny_ckpt), block_size=8, max_num_batched_tokens=16)
    lm = llm.engine.runner.model
    layer = lm.model.layers[0]
    assert layer.self_attn.qkv_in.folded and layer.mlp.gate_up_in.folded
    assert [layer.self_attn.qkv_in.plan(r) for r in (1, 2, 16)] == ["gemv", "folded", "folded"]
    assert [layer.mlp.gate_up_in.plan(r) for r in (1, 2, 16)] == ["gemv", "folded", "folded"]
    # The fold itself: qkv rows are the checkpoint's q / k / v times the input norm's weight; the norm is ones.
    sd = load_file(str(next(tiny_ckpt.glob("*.safetensors"))))
    g1 = sd["model.layers.0.input_layernorm.weight"].float()
    assert not torch.allclose(g1, torch.ones_like(g1))  # random norm weights: the fold is not a no-op
    q = sd["model.layers.0.self_attn.q_proj.weight"].float()
    torch.testing.assert_close(layer.self_attn.qkv_proj.weight[:q.shape[0]].float(), q * g1[None, :])
    assert torch.equal(layer.input_layernorm.weight, torch.ones_like(layer.input_layernorm.weight))
    assert torch.equal(layer.post_attention_layernorm.weight,
                       torch.ones_like(layer.post_attention_layernorm.weight))
    # Which norms still run: only the final one in batched steps (decode rows > 1 and prompt chunks).
    seen = _record_norm_calls(monkeypatch)
    outs = _greedy(llm, [r[0] for r in refs])
    assert [o.outputs[0].token_ids for o in outs] == [r[1] for r in refs]
    batched = [w for rows, w in seen if rows > 1 and w.shape == lm.model.norm.weight.shape]
    assert batched and all(w is lm.model.norm.weight for w in batched)
    # One prompt alone: its decode steps are single rows (the fused norm + GEMV with the folded weights).
    vocab = model.config.vocab_size
    out = llm.generate([{"prompt_token_ids": refs[0][0]}],
                       SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=vocab),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == refs[0][1][:6]
    for step, entry in enumerate(out.outputs[0].logprobs):
        got = torch.tensor([entry[t].logprob for t in range(vocab)])
        torch.testing.assert_close(got, refs[0][2][step].log_softmax(-1), rtol=1e-4, atol=1e-4)


def test_unfused_path_parity(tiny_ckpt, hf_refs, monkeypatch):
    """GYRFALCON_DISABLE_FUSION=1 (the baseline of fused-vs-unfused benchmarks) keeps the separate norm / rotary /
    store kernels and folds no norm: the checkpoint's weights stay as they are and each layer's two RMSNorms
    launch in every step. The same tokens as transformers."""
    monkeypatch.setenv("GYRFALCON_DISABLE_FUSION", "1")
    _, _, refs = hf_refs
    llm = LLM(str(tiny_ckpt), block_size=8, max_num_batched_tokens=16)
    layer = llm.engine.runner.model.model.layers[0]
    assert not layer.self_attn.fused and not layer.self_attn.qkv_in.folded
    assert [layer.self_attn.qkv_in.plan(r) for r in (1, 16)] == ["separate", "separate"]
    w = layer.input_layernorm.weight
    assert not torch.equal(w, torch.ones_like(w))  # the checkpoint's random norm weight, not folded away
    seen = _record_norm_calls(monkeypatch)
    outs = _greedy(llm, [r[0] for r in refs])
    assert [o.outputs[0].token_ids for o in outs] == [r[1] for r in refs]
    assert any(rows > 1 and wt is w for rows, wt in seen)  # layer 0's input norm ran on a batched step
    assert any(rows == 1 and wt is w for rows, wt in seen)  # ... and on a single-row one
