"""Stream-K skinny GEMM (kernels/skinny_gemm.py) against F.linear (+ the in-place add), with the programs'
K ranges cut so that tiles are whole, split over two or over many programs."""

from __future__ import annotations

import pytest
import torch

from gyrfalcon.kernels.skinny_gemm import SkinnyConfig, default_config, skinny_gemm_ref, skinny_gemm_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _data(M, K, N, dtype, seed=0):
    g = torch.Generator().manual_seed(seed + M * 1000 + K + N)
    x = torch.randn(M, K, generator=g).to(dtype).to(DEV)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype).to(DEV)
    r = torch.randn(M, N, generator=g).to(dtype).to(DEV)
    return x, w, r


def _tol(dtype):
    return dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("M", [1, 5, 16, 33])
@pytest.mark.parametrize("K,N", [(64, 48), (96, 80), (40, 16)])
@pytest.mark.parametrize("programs", [1, 3, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_linear(M, K, N, programs, dtype):
    """block_n 16 / block_k 32: K 96 is three steps a tile (7 programs split tiles unevenly, some programs
    hold a tile's middle only), K 40 two with a ragged last step, N 80 five tiles, 48 three; 1 program
    stores every tile whole."""
    x, w, _ = _data(M, K, N, dtype)
    y = skinny_gemm_triton(x, w, config=SkinnyConfig(16, 32, 4, 1, programs))
    assert y.shape == (M, N) and y.dtype == dtype
    torch.testing.assert_close(y, skinny_gemm_ref(x, w), **_tol(dtype))


@pytest.mark.parametrize("programs", [2, 5, 11])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_to_in_place(programs, dtype):
    """add_to: the product added into the given tensor (the residual stream), which is returned."""
    M, K, N = 6, 96, 64
    x, w, r = _data(M, K, N, dtype, seed=1)
    expect = skinny_gemm_ref(x, w, add_to=r.clone())
    out = r.clone()
    got = skinny_gemm_triton(x, w, add_to=out, config=SkinnyConfig(16, 32, 4, 1, programs))
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, expect, **_tol(dtype))


def test_counters_left_at_zero_and_repeatable():
    """Each launch leaves its arrival counters at zero (a graph replays the same launch), so a second
    launch over the same buffers gives the same result; programs above the number of K steps are capped."""
    from gyrfalcon.kernels.small_m_gemv import _split_counters

    M, K, N = 4, 96, 48
    x, w, _ = _data(M, K, N, torch.float32, seed=2)
    cfg = SkinnyConfig(16, 32, 4, 1, 4)  # 3 tiles x 3 steps over 4 programs: every tile split
    y1 = skinny_gemm_triton(x, w, config=cfg)
    assert int(_split_counters(x.device, 3)[:8].abs().sum()) == 0
    y2 = skinny_gemm_triton(x, w, config=cfg)
    torch.testing.assert_close(y1, y2, rtol=0, atol=0)
    y3 = skinny_gemm_triton(x, w, config=cfg._replace(programs=1000))  # capped at the 9 K steps
    torch.testing.assert_close(y3, skinny_gemm_ref(x, w), rtol=1e-4, atol=1e-4)


def test_rows_up_to_max_and_empty():
    """128 rows (BLOCK_M 128) and empty inputs."""
    M, K, N = 128, 32, 32
    x, w, _ = _data(M, K, N, torch.float32, seed=3)
    y = skinny_gemm_triton(x, w, config=SkinnyConfig(16, 16, 4, 1, 3))
    torch.testing.assert_close(y, skinny_gemm_ref(x, w), rtol=1e-4, atol=1e-4)
    assert skinny_gemm_triton(x[:0], w).shape == (0, N)
    with pytest.raises(AssertionError):
        skinny_gemm_triton(torch.zeros(129, K, device=DEV), w)


def test_default_config(monkeypatch):
    """128-row weight tiles, 128 inputs a step, stages within the shared-memory budget; the env override."""
    monkeypatch.delenv("GYRFALCON_SKINNY_CONFIG", raising=False)
    assert default_config(16, 6144, 4096) == SkinnyConfig(128, 128, 4, 4)
    assert default_config(64, 6144, 4096) == SkinnyConfig(128, 128, 8, 3)
    assert default_config(128, 4096, 14336) == SkinnyConfig(128, 128, 8, 2)
    assert default_config(16, 64, 48).block_k == 64
    monkeypatch.setenv("GYRFALCON_SKINNY_CONFIG", "256,64,8,4")
    assert default_config(64, 6144, 4096) == SkinnyConfig(256, 64, 8, 4)
