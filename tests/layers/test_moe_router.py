"""layers/moe.py Router against hand-computed cases (no ties): softmax top-k with and without renormalization,
sigmoid selection with e_score_correction_bias (MiniMax-M2), DeepSeek's grouped noaux_tc, and the logits'
dtype handling."""

from __future__ import annotations

import math

import pytest
import torch

from gyrfalcon.layers.moe import Router


def _sig(x):
    return 1.0 / (1.0 + math.exp(-x))


def _router(E, k, **kw):
    r = Router(4, E, k, **kw)
    r.weight.data.zero_()
    return r


def _check(got, ids, weights):
    w, i = got
    assert w.dtype == torch.float32
    order = w.argsort(dim=-1, descending=True)  # compare as sets: the order of top-k is free
    assert i.gather(1, order).tolist() == ids
    torch.testing.assert_close(w.gather(1, order), torch.tensor(weights, dtype=torch.float32), rtol=1e-6, atol=1e-7)


def test_softmax_topk_renormalized_and_not():
    logits = torch.tensor([[1.0, 3.0, 0.0, 2.0], [0.5, -1.0, 2.5, 0.0]])
    for norm in (True, False):
        r = _router(4, 2, scoring="softmax", norm_topk_prob=norm)
        got = r.select(logits)
        rows = []
        for row in logits.tolist():
            z = sum(math.exp(v) for v in row)
            p = sorted(((math.exp(v) / z, j) for j, v in enumerate(row)), reverse=True)[:2]
            s = sum(v for v, _ in p) if norm else 1.0
            rows.append(([j for _, j in p], [v / s for v, _ in p]))
        _check(got, [r_[0] for r_ in rows], [r_[1] for r_ in rows])
    # Hand values for row 0 with renormalization: experts 1 and 3, e^3 / (e^3 + e^2) and e^2 / (e^3 + e^2).
    w, i = _router(4, 2, scoring="softmax", norm_topk_prob=True).select(logits[:1])
    assert sorted(i[0].tolist()) == [1, 3]
    assert abs(w[0].max().item() - 1 / (1 + math.exp(-1))) < 1e-6


def test_sigmoid_bias_selects_but_does_not_weight():
    """MiniMax-M2: the bias moves expert 2 into the top-2 although its own score is lower; the weights are the
    chosen experts' unbiased sigmoid scores, normalized to 1."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    r = _router(4, 2, scoring="sigmoid", norm_topk_prob=True, use_bias=True)
    r.e_score_correction_bias.data.copy_(torch.tensor([0.0, 0.0, 0.3, 0.0]))
    # biased: s0 = .881, s1 = .731, s2 = .622 + .3 = .922, s3 = .269 -> experts 2 and 0
    s0, s2 = _sig(2.0), _sig(0.5)
    _check(r.select(logits), [[0, 2]], [[s0 / (s0 + s2), s2 / (s0 + s2)]])
    # Without normalization, a scaling factor multiplies the raw scores.
    r2 = _router(4, 2, scoring="sigmoid", norm_topk_prob=False, use_bias=True, routed_scaling_factor=2.0)
    r2.e_score_correction_bias.data.copy_(r.e_score_correction_bias.data)
    _check(r2.select(logits), [[0, 2]], [[2 * s0, 2 * s2]])


def test_grouped_noaux_tc():
    """8 experts in 4 groups of 2, keep 2 groups, top-3. Group scores (sum of the top-2 biased scores of the
    group's 2 experts) pick groups 1 and 3 although expert 0 alone has the highest score; weights = unbiased
    sigmoid scores normalized, x 2.5."""
    logits = torch.tensor([[3.0, -3.0, 1.0, 1.2, -2.0, -1.5, 0.8, 0.9]])
    bias = torch.tensor([0.0, 0.0, 0.05, 0.0, 0.0, 0.0, 0.0, 0.1])
    r = _router(8, 3, scoring="sigmoid", norm_topk_prob=True, use_bias=True, n_group=4, topk_group=2,
                routed_scaling_factor=2.5)
    r.e_score_correction_bias.data.copy_(bias)
    s = [_sig(v) for v in logits[0].tolist()]
    b = [si + bi for si, bi in zip(s, bias.tolist())]
    groups = [b[0] + b[1], b[2] + b[3], b[4] + b[5], b[6] + b[7]]
    assert sorted(range(4), key=lambda g: -groups[g])[:2] == [1, 3]
    # Within groups 1 and 3 by biased score: 3 (.769), 2 (.781 = .731 + .05), 7 (.811 = .711 + .1), 6 (.690).
    chosen = sorted([2, 3, 6, 7], key=lambda e: -b[e])[:3]
    assert sorted(chosen) == [2, 3, 7]
    tot = sum(s[e] for e in chosen)
    by_w = sorted(chosen, key=lambda e: -s[e])
    _check(r.select(logits), [by_w], [[2.5 * s[e] / tot for e in by_w]])
    # Ungrouped, the same router would take expert 0 (the highest score) first.
    flat = _router(8, 3, scoring="sigmoid", norm_topk_prob=True, use_bias=True, routed_scaling_factor=2.5)
    flat.e_score_correction_bias.data.copy_(bias)
    assert 0 in flat.select(logits)[1][0].tolist()


def test_logits_dtype():
    """Qwen3-MoE / MiniMax-M2 (as transformers runs them): the logits GEMM in x's dtype, the scores in fp32;
    DeepSeek (logits_fp32): the GEMM itself in fp32."""
    torch.manual_seed(0)
    x = torch.randn(5, 16).to(torch.bfloat16)
    r = Router(16, 8, 2, scoring="softmax")
    r.weight.data.copy_(torch.randn(8, 16))
    r = r.to(torch.bfloat16)
    assert r.logits(x).dtype == torch.bfloat16
    w, ids = r(x)
    assert w.dtype == torch.float32 and ids.shape == (5, 2)
    r.logits_fp32 = True
    lf = r.logits(x)
    assert lf.dtype == torch.float32
    torch.testing.assert_close(lf, x.float() @ r.weight.float().t())


def test_bad_configs():
    with pytest.raises(ValueError, match="scoring"):
        Router(4, 8, 2, scoring="relu")
    with pytest.raises(ValueError, match="n_group"):
        Router(4, 8, 2, scoring="sigmoid", n_group=3)
    with pytest.raises(ValueError, match="top_k"):
        Router(4, 4, 5)


def test_sparse_moe_block_with_gated_shared_expert():
    """SparseMoE against a plain computation: norm(hidden + residual) -> routed experts (softmax top-2,
    renormalized) + shared SwiGLU expert x sigmoid(shared_expert_gate); the stream carried on."""
    from gyrfalcon.layers.moe import SparseMoE
    from gyrfalcon.layers.norm import RMSNorm

    torch.manual_seed(0)
    H, E, k, inter, shared_inter, T = 16, 6, 2, 8, 12, 5
    moe = SparseMoE(H, E, k, inter, shared_intermediate_size=shared_inter, shared_gate=True, scoring="softmax",
                    norm_topk_prob=True)
    for p in moe.parameters():
        p.data.copy_(torch.randn(p.shape) * 0.3)
    norm = RMSNorm(H, 1e-6)
    norm.weight.data.copy_(1 + 0.3 * torch.randn(H))
    moe.bind_input_norm(norm)
    hidden, residual = torch.randn(T, H), torch.randn(T, H)
    out, res = moe(hidden, residual)
    s = hidden + residual
    x = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    probs = (x @ moe.gate.weight.t()).softmax(-1)
    w, ids = probs.topk(k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    ref = torch.zeros(T, H)
    for t in range(T):
        for j in range(k):
            e = ids[t, j]
            g, u = (moe.experts.w13[e] @ x[t]).split(inter)
            ref[t] += w[t, j] * (moe.experts.w2[e] @ (torch.nn.functional.silu(g) * u))
        sh = moe.shared_expert.gate_up_proj.weight @ x[t]
        y = moe.shared_expert.down_proj.weight @ (torch.nn.functional.silu(sh[:shared_inter]) * sh[shared_inter:])
        ref[t] += torch.sigmoid(moe.shared_expert_gate.weight @ x[t]) * y
    torch.testing.assert_close(res, s)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # DeepSeek's naming (shared_experts, no gate): the parameter lands under that name.
    ds = SparseMoE(H, E, k, inter, shared_intermediate_size=shared_inter, shared_name="shared_experts",
                   scoring="sigmoid", use_bias=True, n_group=2, topk_group=1, routed_scaling_factor=2.5)
    names = {n for n, _ in ds.named_parameters()}
    assert "shared_experts.gate_up_proj.weight" in names and "gate.e_score_correction_bias" in names
    assert ds.shared_expert_gate is None


def test_qwen3_moe_dense_layers_match_transformers():
    """mlp_only_layers and decoder_sparse_step place the dense layers where transformers does."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from gyrfalcon.models.qwen3_moe import is_sparse_layer

    for step, only in ((1, []), (2, []), (2, [3]), (3, [0, 2])):
        cfg = Qwen3MoeConfig(num_hidden_layers=6, decoder_sparse_step=step, mlp_only_layers=only, num_experts=4,
                             hidden_size=16, intermediate_size=8, moe_intermediate_size=8, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=8, vocab_size=32)
        with torch.device("meta"):
            hf = Qwen3MoeForCausalLM(cfg)
        want = [hasattr(layer.mlp, "experts") for layer in hf.model.layers]
        assert [is_sparse_layer(cfg, i) for i in range(6)] == want
        assert any(want) and (step == 1 and not only) == all(want)
