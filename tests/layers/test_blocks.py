"""The shared blocks: a DecoderLayer of RotarySelfAttention + GatedMLP against a plain-torch pre-norm layer, on
each of the norm -> linear paths (its own kernel, fused into the single-row GEMV, folded into the weights by
fold_norms), and the model files as compositions of these blocks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gyrfalcon.forward_context import forward_context
from gyrfalcon.layers.decoder import DecoderLayer
from gyrfalcon.layers.mlp import GatedMLP
from gyrfalcon.layers.norm_linear import NormLinear, fold_norms, norm_stream
from gyrfalcon.layers.rotary import RotaryEmbedding
from gyrfalcon.layers.self_attention import RotarySelfAttention
from layers_testutil import kv_cache, step_batch

HID, H, HKV, D, FF, BS, EPS = 32, 4, 2, 16, 48, 8, 1e-6


def _layer(seed: int = 0, qk_norm: bool = True) -> DecoderLayer:
    attn = RotarySelfAttention(HID, H, HKV, D, 0, RotaryEmbedding(D, D, 64, None),
                               qk_norm_eps=EPS if qk_norm else None)
    layer = DecoderLayer(HID, EPS, attn, GatedMLP(HID, FF))
    g = torch.Generator().manual_seed(seed)
    for p in layer.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.2) + (p.dim() == 1))
    return layer


def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def _reference(layer: DecoderLayer, x: torch.Tensor) -> torch.Tensor:
    """The layer's math for one sequence of T tokens from position 0, plain torch, from weights taken before any
    fold: x + attn(norm(x)), then + mlp(norm(.))."""
    a, m = layer.self_attn, layer.mlp
    T = x.shape[0]
    q, k, v = F.linear(_rms(x, layer.input_layernorm.weight), a.qkv_proj.weight).split([H * D, HKV * D, HKV * D], -1)
    q, k, v = q.view(T, H, D), k.view(T, HKV, D), v.view(T, HKV, D)
    if a.use_qk_norm:
        q, k = _rms(q, a.q_norm.weight), _rms(k, a.k_norm.weight)
    cos, sin = a.rotary_emb.cos_sin_cache[:T].chunk(2, -1)

    def rope(t):
        t1, t2 = t.chunk(2, -1)
        c, s = cos[:, None], sin[:, None]
        return torch.cat([t1 * c - t2 * s, t2 * c + t1 * s], -1)

    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * D ** -0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(T, H * D)
    h = x + F.linear(o, a.o_proj.weight)
    gate, up = F.linear(_rms(h, layer.post_attention_layernorm.weight), m.gate_up_proj.weight).chunk(2, -1)
    return h + F.linear(F.silu(gate) * up, m.down_proj.weight)


def _prefill(layer, x):
    """All T tokens in one step -> (the stream after the layer, summed, [T, HID]; the plan each pair took)."""
    fb = step_batch([0], [x.shape[0]], [[0, 1]], BS)
    with torch.no_grad(), forward_context(fb, [kv_cache(2, BS, HKV, D)]):
        hidden, residual = layer(fb.positions, x.clone(), None)
    out = residual if hidden is None else hidden + residual
    return out, layer.self_attn.qkv_in.plan(x.shape[0])


def _one_token_at_a_time(layer, x):
    caches = [kv_cache(2, BS, HKV, D)]
    rows = []
    for p in range(x.shape[0]):
        fb = step_batch([p], [1], [[0, 1]], BS)
        with torch.no_grad(), forward_context(fb, caches):
            hidden, residual = layer(fb.positions, x[p:p + 1].clone(), None)
        rows.append(hidden + residual)
    return torch.cat(rows)


@pytest.mark.parametrize("qk_norm", [True, False], ids=["qwen3", "llama"])
def test_decoder_layer_paths_match_plain_torch(qk_norm):
    layer = _layer(qk_norm=qk_norm)
    x = torch.randn(6, HID, generator=torch.Generator().manual_seed(9))
    want = _reference(layer, x)
    got, plan = _prefill(layer, x)  # several rows, nothing folded: the norm as its own kernel
    assert plan == "separate"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_one_token_at_a_time(layer, x), want, rtol=1e-5, atol=1e-5)  # norm in the GEMV
    assert layer.self_attn.qkv_in.plan(1) == "gemv"
    assert fold_norms(layer) == 2 and fold_norms(layer) == 0  # once
    assert torch.equal(layer.input_layernorm.weight, torch.ones(HID))
    got, plan = _prefill(layer, x)
    assert plan == "folded"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_one_token_at_a_time(layer, x), want, rtol=1e-5, atol=1e-5)


def test_unfused_layer_never_folds(monkeypatch):
    """GYRFALCON_DISABLE_FUSION=1: every batch runs the norm as its own kernel and fold_norms folds nothing."""
    monkeypatch.setenv("GYRFALCON_DISABLE_FUSION", "1")
    layer = _layer()
    assert not layer.self_attn.fused
    assert [layer.mlp.gate_up_in.plan(r) for r in (1, 2, 64)] == ["separate"] * 3
    assert fold_norms(layer) == 0
    x = torch.randn(5, HID, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(_prefill(layer, x)[0], _reference(layer, x), rtol=1e-5, atol=1e-5)


def test_norm_linear_stream_forms():
    """The stream may arrive carried (hidden + residual), or added in place (hidden None): every plan gives
    norm(hidden + residual) @ W^T and the sum."""
    layer = _layer()
    pair = layer.self_attn.qkv_in
    g = torch.Generator().manual_seed(4)
    h, r = torch.randn(3, HID, generator=g), torch.randn(3, HID, generator=g)
    want = F.linear(_rms(h + r, layer.input_layernorm.weight), layer.self_attn.qkv_proj.weight)
    for hidden, residual in ((h, r), (None, h + r), (h + r, None)):
        n = pair(hidden, residual)
        assert n.row_scale is None and not n.in_place
        torch.testing.assert_close(n.y, want)
        torch.testing.assert_close(n.residual, h + r)
    fold_norms(layer)
    n = pair(h, r)  # folded: the sum, and each row still to scale by its rstd
    assert n.in_place and n.row_scale[0] is n.residual
    torch.testing.assert_close(n.y * torch.rsqrt((h + r).pow(2).mean(-1, keepdim=True) + EPS), want)
    torch.testing.assert_close(norm_stream(layer.input_layernorm, None, h + r)[0], _rms(h + r, 1.0))


def test_model_files_compose_blocks():
    """A model file is a config -> blocks mapping: Llama and Qwen3 build DecoderLayers of RotarySelfAttention and
    GatedMLP (Qwen3 with q / k norms), each norm declared with the linear it feeds; kv_cache_specs from the
    attention layers."""
    from transformers import LlamaConfig, Qwen3Config

    from gyrfalcon.cache_spec import FullAttentionSpec
    from gyrfalcon.models.llama import LlamaForCausalLM
    from gyrfalcon.models.qwen3 import Qwen3ForCausalLM

    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
    for cls, cfg, qk in ((LlamaForCausalLM, LlamaConfig(**kw), False),
                         (Qwen3ForCausalLM, Qwen3Config(head_dim=16, **kw), True)):
        m = cls(cfg)
        for layer in m.model.layers:
            assert type(layer) is DecoderLayer
            assert isinstance(layer.self_attn, RotarySelfAttention) and isinstance(layer.mlp, GatedMLP)
            assert layer.self_attn.use_qk_norm == qk
            assert layer.self_attn.qkv_in.norm is layer.input_layernorm
            assert layer.mlp.gate_up_in.linear is layer.mlp.gate_up_proj
        assert sum(isinstance(x, NormLinear) for x in m.modules()) == 4
        hd = 16 if qk else 8
        assert m.kv_cache_specs("float8_e4m3fn") == {0: FullAttentionSpec(2, hd, "float8_e4m3fn"),
                                                     1: FullAttentionSpec(2, hd, "float8_e4m3fn")}
        # no parameter under two names: the pairs hold their norm and linear without registering them
        names = [n for n, _ in m.named_parameters(remove_duplicate=False)]
        assert not any("qkv_in" in n or "gate_up_in" in n for n in names)
