"""The batch-1 MLP in one launch (kernels/fused_mlp.py) against the unfused references, and against the two
launches it replaces (norm_gemv with SiLU-and-mul, then norm_gemv on down_proj)."""

from __future__ import annotations

import pytest
import torch

from gyrfalcon.kernels.fused_mlp import (FusedMlpConfig, _workspace, fused_mlp_config, fused_mlp_ref,
                                         fused_mlp_triton)
from gyrfalcon.kernels.small_m_gemv import norm_gemv_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _data(H, I, dtype, seed=0):
    g = torch.Generator().manual_seed(seed * 7919 + H * 31 + I)
    x = torch.randn(1, H, generator=g).to(dtype).to(DEV)
    r = torch.randn(1, H, generator=g).to(dtype).to(DEV)
    nw = (1 + 0.2 * torch.randn(H, generator=g)).to(dtype).to(DEV)
    wgu = (torch.randn(2 * I, H, generator=g) / H ** 0.5).to(dtype).to(DEV)
    wd = (torch.randn(H, I, generator=g) / I ** 0.5).to(dtype).to(DEV)
    return x, r, nw, wgu, wd


@pytest.mark.parametrize("H,I,cfg", [
    (64, 96, FusedMlpConfig(16, 64, 64, 4)),     # every tile whole: no loop after the wait
    (200, 72, FusedMlpConfig(16, 64, 32, 4)),   # K and H loops with masked tails, I not a multiple of BLOCK_I
    (48, 40, FusedMlpConfig(32, 16, 16, 4)),    # one program's units run past I
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_unfused(H, I, cfg, dtype):
    x, r, nw, wgu, wd = _data(H, I, dtype)
    y_ref, r_ref = fused_mlp_ref(x, r, nw, wgu, wd, eps=1e-6)
    y, r_new = fused_mlp_triton(x, r, nw, wgu, wd, eps=1e-6, config=cfg, pdl=False)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(y, y_ref, **tol)
    rt = dict(rtol=0, atol=0) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(r_new, r_ref, **rt)
    assert y.shape == (1, H) and y.dtype == dtype
    # The accumulator and the arrival counter are left at zero for the next launch.
    acc, cnt = _workspace(x.device)
    assert int(cnt.item()) == 0 and float(acc.abs().max()) == 0.0


def test_matches_the_two_launches_it_replaces():
    """Against norm_gemv (norm + gate_up + SiLU-and-mul) then norm_gemv (down_proj): the same roundings, only
    down_proj's fp32 sum in another order (fp32 weights: agreement to fp32 rounding)."""
    x, r, nw, wgu, wd = _data(128, 80, torch.float32, seed=3)
    act, r_two = norm_gemv_triton(x, wgu, nw, r, 1e-6, silu_mul=True, block_n=16, block_k=64, pdl=False)
    y_two, _ = norm_gemv_triton(act, wd, block_n=16, block_k=64, pdl=False)
    y, r_new = fused_mlp_triton(x, r, nw, wgu, wd, 1e-6, config=FusedMlpConfig(16, 64, 64, 4), pdl=False)
    torch.testing.assert_close(y, y_two, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r_new, r_two, rtol=0, atol=0)


def test_back_to_back_launches_reuse_the_zeroed_workspace():
    """Two launches of different shapes in a row (two layers, two models): each starts from a zero accumulator."""
    a = _data(64, 48, torch.float32, seed=1)
    b = _data(96, 64, torch.float32, seed=2)
    for args in (a, b, a):
        y, _ = fused_mlp_triton(*args, eps=1e-6, config=FusedMlpConfig(16, 32, 32, 4), pdl=False)
        torch.testing.assert_close(y, fused_mlp_ref(*args, eps=1e-6)[0], rtol=1e-4, atol=1e-4)


def test_launch_shape_from_the_problem(monkeypatch):
    """At most one program an SM; gate / up tiles up to 64 KB and the first down tile up to 32 KB before the wait."""
    monkeypatch.delenv("GYRFALCON_FUSED_MLP_BLOCK_I", raising=False)
    assert fused_mlp_config(1024, 3072, 2, 132) == FusedMlpConfig(32, 512, 512, 8)  # Qwen3-0.6B: 96 programs
    assert fused_mlp_config(4096, 14336, 2, 132) == FusedMlpConfig(128, 128, 128, 8)  # Llama-3.1-8B: 112
    assert fused_mlp_config(2048, 6144, 2, 132) == FusedMlpConfig(64, 256, 256, 8)  # Qwen3-1.7B: 96
    monkeypatch.setenv("GYRFALCON_FUSED_MLP_BLOCK_I", "16")
    assert fused_mlp_config(1024, 3072, 2, 132) == FusedMlpConfig(16, 1024, 1024, 8)  # every tile whole: 192


def test_switch_is_off_by_default(monkeypatch):
    from gyrfalcon.kernels.fused_mlp import fused_mlp_enabled
    monkeypatch.delenv("GYRFALCON_FUSED_MLP", raising=False)
    assert not fused_mlp_enabled()
    monkeypatch.setenv("GYRFALCON_FUSED_MLP", "1")
    assert fused_mlp_enabled()


def test_mlp_chain_benchmark_matches_the_two_launches():
    """benchmarks/small_m_gemv.py --mlp-chain's layer chain (qkv GEMV, decode attention with its prep, o GEMV,
    then the MLP), small, under the interpreter: the fused MLP's chain output equals the two launches', and so
    does the chain with decode attention and o_proj in one launch as well."""
    from benchmark_scripts import load_benchmark

    bench = load_benchmark("small_m_gemv")
    c = bench.QwenB1Chain(device=DEV, dtype=torch.float32, H=2, KV=1, D=16, hid=64, inter=96, layers=2, ctx=20)
    two = c.step(c.distinct, False)
    fused = c.step(c.distinct, False, FusedMlpConfig(16, 32, 32, 4))
    assert two.shape == (1, 64) and float(two.abs().max()) > 1e-3  # not a chain of zeros
    torch.testing.assert_close(fused, two, rtol=1e-4, atol=1e-4)
    # decode attention and o_proj in one launch too (3 launches a layer)
    both = c.step(c.distinct, False, FusedMlpConfig(16, 32, 32, 4), attn_o_proj=True)
    torch.testing.assert_close(both, two, rtol=1e-4, atol=1e-4)
