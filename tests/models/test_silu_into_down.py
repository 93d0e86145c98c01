"""GYRFALCON_SILU_INTO_DOWN on the CPU: LlamaDecoderLayer's routing and its MLP half through the two GEMV launches
(o_proj's sumsq, down_proj's silu_x) under the Triton interpreter, against the same layer's SiLU kernel path. The
attention itself is replaced by a fixed o_proj input (its kernels are GPU-tested: tests/gpu, mode silu-down)."""

import pytest
import torch
from transformers import LlamaConfig

import gyrfalcon.layers.linear as linear_mod
from gyrfalcon.models.llama import LlamaDecoderLayer


def _layer(monkeypatch, on: bool) -> LlamaDecoderLayer:
    monkeypatch.setenv("GYRFALCON_SILU_INTO_DOWN", "1" if on else "0")
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, rms_norm_eps=1e-5)
    layer = LlamaDecoderLayer(cfg, 0, 128)
    g = torch.Generator().manual_seed(0)
    for p in layer.parameters():
        p.data = torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5
    return layer


def test_routing(monkeypatch):
    monkeypatch.setattr(linear_mod, "use_triton", lambda t: True)  # the GEMV route, as on a GPU
    layer = _layer(monkeypatch, True)
    assert [layer.silu_into_down(torch.zeros(m, 64)) for m in (1, 2, 16, 17)] == [False, True, True, False]
    assert not _layer(monkeypatch, False).silu_into_down(torch.zeros(4, 64))
    monkeypatch.setattr(linear_mod, "use_triton", lambda t: False)  # CPU tensors: the reference path
    assert not layer.silu_into_down(torch.zeros(4, 64))


@pytest.mark.parametrize("rows", [2, 5])
def test_mlp_half_matches_the_silu_kernel_path(monkeypatch, rows):
    monkeypatch.setattr(linear_mod, "use_triton", lambda t: True)
    g = torch.Generator().manual_seed(rows)
    attn_out = torch.randn(rows, 64, generator=g)
    x0 = torch.randn(rows, 64, generator=g)
    outs = []
    for on in (True, False):
        layer = _layer(monkeypatch, on)
        seen = {}

        def fake_attention(positions, x, qkv=None, row_scale=None, add_to=None, sumsq=False, _layer=layer, _seen=seen):
            _seen["sumsq"] = sumsq
            return _layer.self_attn.o_proj(attn_out, add_to=add_to, sumsq=sumsq)

        monkeypatch.setattr(layer.self_attn, "forward", fake_attention)
        x = x0.clone()
        out = layer.forward_folded(torch.arange(rows), x)
        assert out.data_ptr() == x.data_ptr() and seen["sumsq"] == on
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)
