"""Qwen3-Next vs transformers on a tiny random checkpoint (fp32, CPU): three Gated DeltaNet layers and one gated
attention layer, MoE with a gated shared expert, every parameter random (A_log, dt_bias, the conv, the (1 + w)
norms). Prompts run up to ~200 tokens, so prefill chunks cross the rule's 64-token chunks and the state passes
between steps at arbitrary positions. Logits at every prefill and decode position, greedy tokens through chunked
prefill (budgets 7 and 50), async scheduling, preemption (the state slot freed, the request recomputed), slots
reused by later requests, a second round served from the prefix cache (state snapshots; their own tests are in
test_qwen3_next_prefix_caching.py); the Gated DeltaNet reference ops against transformers' torch fallbacks on ragged
batches with initial states."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from checkpoints import make_qwen3_next_checkpoint, step_row
from gyrfalcon import LLM, SamplingParams
from gyrfalcon.cache_spec import FullAttentionSpec, LinearStateSpec
from gyrfalcon.engine.request import Request
from gyrfalcon.forward_context import forward_context
from gyrfalcon.kernels.gated_delta import (causal_conv1d_ref, causal_conv1d_update_ref, chunk_gated_delta_rule_ref,
                                           gdn_gating_ref, recurrent_gated_delta_rule_ref)
from gyrfalcon.layers.gated_deltanet import GatedDeltaNet
from gyrfalcon.layers.moe import SparseMoE
from gyrfalcon.layers.self_attention import RotarySelfAttention
from gyrfalcon.runner.forward_batch import build_forward_batch
from test_model_parity import (  # noqa: F401  (the shared suite where it applies to a state model)
    MAX_NEW, PROMPTS, _assert_all_blocks_free, _greedy, greedy_refs, test_decode_logits_parity,
    family_greedy_parity_under_preemption as test_greedy_parity_under_preemption, test_prompts_span_several_blocks)

LONG_PROMPT = (
    "import json\nimport os\n\n\nclass Config:\n    \"\"\"Settings read from a JSON file.\"\"\"\n\n"
    "    def __init__(self, path):\n        self.path = path\n        self.values = {}\n\n"
    "    def load(self):\n        if not os.path.exists(self.path):\n            return self\n"
    "        with open(self.path) as f:\n            self.values = json.load(f)\n        return self\n\n"
    "    def get(self, key, default=None):\n        return self.values.get(key, default)\n\n"
    "    def set(self, key, value):\n        self.values[key] = value\n        with open(self.path, 'w') as f:\n"
    "            json.dump(self.values, f, indent=2, sort_keys=True)\n")
QN_PROMPTS = PROMPTS + [LONG_PROMPT]


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    return make_qwen3_next_checkpoint(tmp_path_factory.mktemp("qwen3_next"))


@pytest.fixture(scope="module")
def hf_refs(tiny_ckpt):
    """transformers' greedy continuations and their per-step logits, per prompt (this family's prompts)."""
    return greedy_refs(tiny_ckpt, QN_PROMPTS)

def _assert_all_slots_free(llm):
    sm = llm.engine.scheduler.state_manager
    assert sm is not None and sm.num_free_slots == sm.num_slots


def test_prompts_cross_gdn_chunks(hf_refs):
    _, _, refs = hf_refs
    lens = sorted(len(r[0]) for r in refs)
    assert lens[0] == 1 and lens[-1] > 3 * 64 and any(64 < n < 128 for n in lens)


def test_checkpoint_is_fully_random(tiny_ckpt):
    sd = load_file(str(next(tiny_ckpt.glob("*.safetensors"))))
    for name, t in sd.items():
        assert t.unique().numel() > 1, name  # no constant tensor (zeros / ones) left from the init
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in sd and "model.layers.3.self_attn.q_norm.weight" in sd
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in sd
    assert "model.layers.1.mlp.shared_expert_gate.weight" in sd


def test_layers_weights_and_caches(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), block_size=8, max_num_seqs=5)
    runner = llm.engine.runner
    model = runner.model
    layers = model.model.layers
    assert [type(layer.self_attn) for layer in layers] == [GatedDeltaNet] * 3 + [RotarySelfAttention]
    assert all(isinstance(layer.mlp, SparseMoE) and layer.mlp.shared_expert_gate is not None for layer in layers)
    attn = layers[3].self_attn
    assert attn.output_gate and attn.q_norm.weight_offset == 1.0 and attn.rotary_emb.rotary_dim == 8
    # Zero-centred norms everywhere on the residual stream; the GDN output norm plain.
    assert all(n.weight_offset == 1.0 for layer in layers for n in (layer.input_layernorm,
                                                                    layer.post_attention_layernorm))
    assert model.model.norm.weight_offset == 1.0 and not hasattr(layers[0].self_attn.norm, "weight_offset")
    # in_proj_qkvz / in_proj_ba: the checkpoint's per-key-head groups, reordered into flat q | k | v | z and b | a.
    sd = load_file(str(next(tiny_ckpt.glob("*.safetensors"))))
    gdn = layers[1].self_attn
    H, dk, dv, r = 2, 16, 16, 2
    grouped = sd["model.layers.1.linear_attn.in_proj_qkvz.weight"].view(H, 2 * dk + 2 * r * dv, -1)
    flat = gdn.in_proj_qkvz.weight.view(-1, grouped.shape[-1])
    torch.testing.assert_close(flat[dk:2 * dk], grouped[1, :dk], rtol=0, atol=0)  # key head 1's q
    torch.testing.assert_close(flat[H * dk + dk:H * dk + 2 * dk], grouped[1, dk:2 * dk], rtol=0, atol=0)  # its k
    v0 = 2 * H * dk  # value heads 2, 3 (key head 1's) in v, then in z
    torch.testing.assert_close(flat[v0 + 2 * dv:v0 + 4 * dv], grouped[1, 2 * dk:2 * dk + r * dv], rtol=0, atol=0)
    z0 = v0 + 4 * dv
    torch.testing.assert_close(flat[z0 + 2 * dv:z0 + 4 * dv], grouped[1, 2 * dk + r * dv:], rtol=0, atol=0)
    ba = sd["model.layers.1.linear_attn.in_proj_ba.weight"].view(H, 2 * r, -1)
    torch.testing.assert_close(gdn.in_proj_ba.weight, torch.cat([ba[:, :r].reshape(-1, ba.shape[-1]),
                                                                 ba[:, r:].reshape(-1, ba.shape[-1])]), rtol=0, atol=0)
    # Cache specs: a state slot for each GDN layer, paged K/V for the attention layer; pools of max_num_seqs slots and
    # the padding slot of the decode graphs.
    specs = model.kv_cache_specs("float32")
    assert specs[3] == FullAttentionSpec(2, 32, "float32")
    assert all(specs[i] == LinearStateSpec((3, 128), (4, 16, 16), "float32", "float32") for i in range(3))
    assert runner.num_state_slots == 5 and llm.engine.scheduler.state_manager.num_slots == 5
    conv, rec = runner.kv_caches[0]
    assert conv.shape == (6, 3, 128) and rec.shape == (6, 4, 16, 16) and rec.dtype == torch.float32


# ---- the reference ops against transformers' torch fallbacks -----------------------------------------------------

@pytest.mark.parametrize("num_k_heads", [4, 2], ids=["gva1", "gva2"])
def test_reference_ops_match_transformers(num_k_heads):
    """Ragged batches (lengths 70, 1, 130, 5: none a multiple of 64) with initial states from slots where a
    sequence continues, zeros where it starts; the final states land in the slots."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    torch.manual_seed(0)
    HV, dk, dv, C, K = 4, 16, 8, 24, 4
    lens = [70, 1, 130, 5]
    qsl = torch.tensor([0] + lens).cumsum(0)
    T = int(qsl[-1])
    slots, has_init = torch.tensor([3, 0, 5, 1]), torch.tensor([True, False, True, True])
    q, k = torch.randn(T, num_k_heads, dk), torch.randn(T, num_k_heads, dk)
    v, a, b = torch.randn(T, HV, dv), torch.randn(T, HV), torch.randn(T, HV)
    A_log, dt_bias = torch.rand(HV).clamp_min(0.05).log(), torch.randn(HV)
    g, beta = gdn_gating_ref(a, b, A_log, dt_bias)
    torch.testing.assert_close(g, -A_log.exp() * F.softplus(a + dt_bias))
    init = 0.1 * torch.randn(6, HV, dk, dv)
    states = init.clone()
    o = chunk_gated_delta_rule_ref(q, k, v, g, beta, states, slots, qsl, has_init)
    for i in range(len(lens)):
        s, e = int(qsl[i]), int(qsl[i + 1])
        ref_o, ref_s = hf.torch_recurrent_gated_delta_rule(
            q[None, s:e], k[None, s:e], v[None, s:e], g[None, s:e], beta[None, s:e],
            initial_state=init[slots[i]][None] if has_init[i] else None, output_final_state=True,
            use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(o[s:e], ref_o[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(states[slots[i]], ref_s[0], rtol=1e-5, atol=1e-5)
    untouched = [j for j in range(6) if j not in slots.tolist()]
    assert torch.equal(states[untouched], init[untouched])
    # Decode: one token per sequence; a sequence at position 0 (a one-token prompt) ignores its slot's contents.
    states = init.clone()
    dslots, dinit = torch.tensor([2, 4, 0]), torch.tensor([True, False, True])
    q1, k1 = torch.randn(3, num_k_heads, dk), torch.randn(3, num_k_heads, dk)
    v1, g1, b1 = torch.randn(3, HV, dv), -torch.rand(3, HV), torch.rand(3, HV)
    o1 = recurrent_gated_delta_rule_ref(q1, k1, v1, g1, b1, states, dslots, dinit)
    init0 = init[dslots] * dinit[:, None, None, None]
    ref_o, ref_s = hf.torch_recurrent_gated_delta_rule(q1[:, None], k1[:, None], v1[:, None], g1[:, None],
                                                       b1[:, None], initial_state=init0, output_final_state=True,
                                                       use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o1, ref_o[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states[dslots], ref_s, rtol=1e-5, atol=1e-5)
    # The conv: prefill chunks from their windows (or zeros), then a one-token update.
    x, w = torch.randn(T, C), torch.randn(C, K)
    conv0 = torch.randn(6, K - 1, C)
    conv = conv0.clone()
    y = causal_conv1d_ref(x, w, conv, slots, qsl, has_init)
    for i in range(len(lens)):
        s, e = int(qsl[i]), int(qsl[i + 1])
        state = (conv0[slots[i]] if has_init[i] else torch.zeros(K - 1, C)).t()[None].clone()
        ref = hf.causal_conv1d_update(x[s:e].t()[None], state, w, None, activation="silu")
        torch.testing.assert_close(y[s:e], ref[0].t(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(conv[slots[i]], state[0].t(), rtol=0, atol=0)
    conv = conv0.clone()
    y1 = causal_conv1d_update_ref(x[:3], w, conv, dslots, dinit)
    state = (conv0[dslots] * dinit[:, None, None]).transpose(1, 2).clone()
    ref = hf.causal_conv1d_update(x[:3, :, None], state, w, None, activation="silu")
    torch.testing.assert_close(y1, ref[:, :, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv[dslots], state.transpose(1, 2), rtol=0, atol=0)


# ---- the model against transformers ------------------------------------------------------------------------------

def test_prefill_logits_parity(tiny_ckpt, hf_refs):
    """Raw logits at every prompt position, all prompts in one ragged batch, in three steps split at 50 and 120
    tokens: the second and third start from the state the earlier ones left in each request's slot."""
    _, model, refs = hf_refs
    llm = LLM(str(tiny_ckpt), block_size=8)
    runner = llm.engine.runner
    bm = llm.engine.block_manager
    reqs = [Request(str(i), r[0], SamplingParams(max_tokens=1)) for i, r in enumerate(refs)]
    for i, req in enumerate(reqs):
        assert bm.allocate_slots(req, req.num_tokens)
        req.state_slots = {"state": len(reqs) - 1 - i}  # what the runner's RequestState carries
    got = {i: [] for i in range(len(reqs))}
    for cut in (50, 120, None):
        sched = []
        for req in reqs:
            n = (req.num_tokens if cut is None else min(cut, req.num_tokens)) - req.num_computed_tokens
            if n > 0:
                sched.append(step_row(req, n, cut is None, req.num_computed_tokens))
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


# Three budget / mode pairs: test_qwen3_5.py runs the other three, so the two families cover all six.
@pytest.mark.parametrize("budget,async_scheduling", [(None, True), (7, False), (50, True)],
                         ids=["whole-async", "7-sync", "50-async"])
def test_greedy_parity(tiny_ckpt, hf_refs, budget, async_scheduling):
    """Prefix caching on (the default snapshot stride): the second round resumes every prompt longer than a block at
    its last block boundary from the state snapshotted there, reusing the freed slots, with the same tokens."""
    _, _, refs = hf_refs
    llm = LLM(str(tiny_ckpt), block_size=8, enable_prefix_caching=True, max_num_batched_tokens=budget,
              async_scheduling=async_scheduling)
    for round_ in range(2):
        outs = _greedy(llm, [r[0] for r in refs])
        for (prompt, ref_tokens, _), out in zip(refs, outs):
            assert out.outputs[0].token_ids == ref_tokens
            assert out.num_cached_tokens == (0 if round_ == 0 else (len(prompt) - 1) // 8 * 8)
        _assert_all_blocks_free(llm)
        _assert_all_slots_free(llm)
    assert llm.engine.block_manager.prefix_hits > 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preemption_frees_and_recomputes_state(tiny_ckpt, hf_refs, async_scheduling):
    """A KV cache far too small for the batch: requests are preempted mid-prefill and mid-decode, their state slots
    go back to the pool (others take them), and the recomputed requests still give transformers' tokens."""
    _, _, refs = hf_refs
    longest = max(len(r[0]) for r in refs) + MAX_NEW
    blocks = -(-longest // 4) + 2
    llm = LLM(str(tiny_ckpt), block_size=4, num_gpu_blocks_override=blocks, max_model_len=longest + 4,
              max_num_batched_tokens=16, max_num_seqs=4, async_scheduling=async_scheduling)
    sched = llm.engine.scheduler
    preempted, holders = [], {}  # (slot before, slot after) per preemption; slot -> requests that held it
    preempt, allocate = sched._preempt, sched.state_manager.allocate

    def spy_preempt(req):
        slot = req.state_slot
        preempt(req)
        preempted.append((slot, req.state_slot))

    def spy_allocate(req):
        ok = allocate(req)
        if ok:
            holders.setdefault(req.state_slot, set()).add(req.request_id)
        return ok
    sched._preempt, sched.state_manager.allocate = spy_preempt, spy_allocate
    outs = _greedy(llm, [r[0] for r in refs] * 2)
    assert sched.num_preemptions_total > 0
    assert preempted and all(before is not None and after is None for before, after in preempted)
    assert max(len(ids) for ids in holders.values()) > 1
    for out, (_, ref_tokens, _) in zip(outs, refs * 2):
        assert out.outputs[0].token_ids == ref_tokens
    _assert_all_blocks_free(llm)
    _assert_all_slots_free(llm)


def test_reused_slot_starts_from_zero(tiny_ckpt, hf_refs):
    """One slot: each request inherits the previous one's state in the pool, the one-token prompt included (its
    first step is decode-shaped); every one starts from zeros and matches transformers. An aborted request's slot
    is freed and reused too."""
    _, _, refs = hf_refs
    llm = LLM(str(tiny_ckpt), block_size=8, max_num_seqs=1)
    order = sorted(range(len(refs)), key=lambda i: -len(refs[i][0]))  # the longest first, "x" (1 token) last
    outs = _greedy(llm, [refs[i][0] for i in order])
    assert [o.outputs[0].token_ids for o in outs] == [refs[i][1] for i in order]
    conv, rec = llm.engine.runner.kv_caches[0]
    assert rec.abs().sum() > 0 and conv.abs().sum() > 0  # the last request left its state behind
    eng = llm.engine
    eng.add_request("abort-me", refs[order[0]][0], SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    eng.step()
    assert eng.scheduler.state_manager.num_free_slots == 0
    eng.abort_request("abort-me")
    while eng.has_unfinished_requests():
        eng.step()
    _assert_all_slots_free(llm)
    out = _greedy(llm, [refs[order[-1]][0]])[0]
    assert out.outputs[0].token_ids == refs[order[-1]][1]


def test_speculative_decoding_tracks_the_linear_state(tiny_ckpt):
    """Speculation on a hybrid model: every Gated DeltaNet layer keeps its state per verify token (1 + k of them)
    for the runner's rollback, and verify steps run eagerly (tests/spec_decode/test_mtp_hybrid.py: parity)."""
    from gyrfalcon.config import EngineConfig
    from gyrfalcon.layers.gated_deltanet import GatedDeltaNet
    from gyrfalcon.runner.model_runner import ModelRunner

    cfg = EngineConfig.create(str(tiny_ckpt), block_size=8, device="cpu")
    cfg.speculative_config.num_speculative_tokens = 2
    runner = ModelRunner(cfg)
    gdn = [m for m in runner.model.modules() if isinstance(m, GatedDeltaNet)]
    assert gdn and runner._rollback_layers == gdn
    assert all(m.verify_len == 3 for m in gdn)


def test_bfloat16_state_dtypes(tiny_ckpt, hf_refs):
    """In bf16 the conv windows follow the model's dtype and the recurrent state stays fp32; the long prompt's
    greedy run goes through chunked prefill and decode and still picks transformers' (fp32) first token."""
    _, _, refs = hf_refs
    llm = LLM(str(tiny_ckpt), block_size=8, dtype="bfloat16", max_num_batched_tokens=50)
    conv, rec = llm.engine.runner.kv_caches[0]
    assert conv.dtype == torch.bfloat16 and rec.dtype == torch.float32
    prompt, ref_tokens, _ = max(refs, key=lambda r: len(r[0]))
    out = _greedy(llm, [prompt])[0]
    assert len(out.outputs[0].token_ids) == MAX_NEW and out.outputs[0].token_ids[0] == ref_tokens[0]
    _assert_all_slots_free(llm)


def test_decode_through_graph_static_inputs(tiny_ckpt, hf_refs):
    """Decode steps through the CUDA-graph runner's static inputs (run eagerly on a CPU, padded to the ladder like
    a graph): each row's state slot comes from the static state_slots buffer, padding rows point at the pools'
    spare slot, whose state they overwrite (poisoned with NaN first: they start from zeros) without touching a
    request's; transformers' tokens, with a prefix-cache round whose restored states are decoded the same way."""
    from gyrfalcon.runner.cuda_graph import CudaGraphRunner

    _, _, refs = hf_refs
    llm = LLM(str(tiny_ckpt), block_size=8, max_num_seqs=5)
    r = llm.engine.runner
    pad = r.cache_plan.padding_slot(r.num_state_slots)
    assert pad == 5 and all(c[0].shape[0] == 6 and c[1].shape[0] == 6 for c in r.kv_caches[:3])
    r.graph_runner = CudaGraphRunner(r.model, r.kv_caches, 5, 1024, r.block_size, r.device, r.last_sampled,
                                     state_padding_slot=pad)
    for conv, rec in r.kv_caches[:3]:
        conv[pad].fill_(float("nan"))
        rec[pad].fill_(float("nan"))
    seen = []
    forward = r.graph_runner._forward
    r.graph_runner._forward = lambda fb, src: seen.append(fb.state_slots.tolist()) or forward(fb, src)
    for round_ in range(2):
        outs = _greedy(llm, [r_[0] for r_ in refs])
        assert [o.outputs[0].token_ids for o in outs] == [r_[1] for r_ in refs]
        assert all(o.num_cached_tokens == (0 if round_ == 0 else (len(r_[0]) - 1) // 8 * 8)
                   for o, r_ in zip(outs, refs))
    # Batches of 5 and fewer were padded to 8, 4 or 2 rows: the padding rows named the spare slot.
    assert any(len(s) > 1 and s[-1] == pad for s in seen)
    for s in seen:  # the requests' own slots (distinct), then the padding rows'
        n = sum(x != pad for x in s)
        assert len(set(s[:n])) == n and max(s[:n]) < pad and s[n:] == [pad] * (len(s) - n)
    _assert_all_slots_free(llm)
