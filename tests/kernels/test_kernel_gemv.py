"""Fused [residual add +] RMSNorm -> GEMV -> [SiLU-and-mul] for decode-sized batches, against the
unfused composition of the references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gyrfalcon.kernels.gemv import norm_gemv_ref, norm_gemv_triton
from kernels_testutil import LaunchSpy

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _data(M, K, N, dtype, silu):
    g = torch.Generator().manual_seed(M * 1000 + K + N)
    x = torch.randn(M, K, generator=g).to(dtype).to(DEV)
    r = torch.randn(M, K, generator=g).to(dtype).to(DEV)
    w = (torch.randn(2 * N if silu else N, K, generator=g) / K ** 0.5).to(dtype).to(DEV)
    nw = (1 + 0.2 * torch.randn(K, generator=g)).to(dtype).to(DEV)
    return x, r, w, nw


@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("K,N", [(64, 48), (200, 96), (32, 16)])
@pytest.mark.parametrize("mode", ["plain", "norm", "norm+res", "norm+res+silu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_unfused(M, K, N, mode, dtype):
    silu = mode.endswith("silu")
    x, r, w, nw = _data(M, K, N, dtype, silu)
    kw = dict(norm_weight=nw if mode != "plain" else None, residual=r if "res" in mode else None,
              eps=1e-6, silu_mul=silu)
    y_ref, r_ref = norm_gemv_ref(x, w, **kw)
    y, r_new = norm_gemv_triton(x, w, block_n=16, block_k=32, **kw)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(y, y_ref, **tol)
    assert y.shape == (M, N)
    if "res" in mode:
        # One bf16 rounding of the same fp32 sum (the interpreter's cast may round differently).
        rt = dict(rtol=0, atol=0) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
        torch.testing.assert_close(r_new, r_ref, **rt)
    else:
        assert r_new is None and r_ref is None


@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("K,N", [(200, 96), (32, 16)])
@pytest.mark.parametrize("mode", ["plain", "norm", "norm+res+silu"])
def test_peeled_first_tile_matches_unfused(M, K, N, mode):
    """The PDL launch's form (peel): the first weight and norm-weight tiles load before the input, the
    loop does the rest (7 tiles of 32 at K = 200; none left at K = 32)."""
    silu = mode.endswith("silu")
    x, r, w, nw = _data(M, K, N, torch.float32, silu)
    kw = dict(norm_weight=nw if mode != "plain" else None, residual=r if "res" in mode else None,
              eps=1e-6, silu_mul=silu)
    y_ref, _ = norm_gemv_ref(x, w, **kw)
    y, _ = norm_gemv_triton(x, w, block_n=16, block_k=32, peel=True, **kw)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)


def test_whole_row_tiles_for_the_peeled_launch():
    """The PDL launch takes one tile over all of K (slices <= 64 KB, 16-bit weights), so that the whole weight
    slice loads before the wait; the plain launch keeps 1024-wide tiles."""
    from gyrfalcon.kernels.gemv import default_config
    assert default_config(1, 1024, 2048).block_k == 1024
    assert default_config(1, 1024, 2048, whole_row=True).block_k == 2048
    assert default_config(1, 1024, 3072, whole_row=True).block_k == 4096
    assert default_config(1, 1024, 1024, whole_row=True).block_k == 1024
    assert default_config(1, 4096, 14336, whole_row=True).block_k == 1024  # too long a row
    assert default_config(1, 14336, 4096, silu_mul=True, whole_row=True).block_k == 1024  # two 64 KB tiles
    assert default_config(1, 1024, 2048, elem_size=4, whole_row=True).block_k == 1024


@pytest.mark.parametrize("mode", ["plain", "norm+res"])
def test_peeled_whole_row_launch_matches_unfused(mode):
    """peel=True with the default config: K = 1500 in one 2048-wide tile (masked past K)."""
    x, r, w, nw = _data(1, 1500, 24, torch.bfloat16, False)
    kw = dict(norm_weight=nw if mode != "plain" else None, residual=r if "res" in mode else None, eps=1e-6)
    y_ref, _ = norm_gemv_ref(x, w, **kw)
    y, _ = norm_gemv_triton(x, w, peel=True, **kw)
    torch.testing.assert_close(y, y_ref, rtol=3e-2, atol=3e-2)


def test_rows_routed_to_the_kernel():
    """How many rows a linear layer sends through this kernel: a norm-less Linear (o_proj, down_proj) 16, the
    merged projections (qkv, gate_up) single rows unless their shape has launch shapes of its own (ROWS_SHAPES:
    16; WIDE_ROWS_SHAPES: MAX_M)."""
    from gyrfalcon.kernels.gemv import GEMV_MAX_ROWS, MAX_M, PLAIN_MAX_ROWS, linear_gemv_rows, norm_gemv_rows
    assert PLAIN_MAX_ROWS == 16 and GEMV_MAX_ROWS == 1 and norm_gemv_rows() == (1, 1)
    assert linear_gemv_rows(4, 8, merged=False) == 16 and linear_gemv_rows(8, 8, merged=True) == 1
    assert linear_gemv_rows(6144, 4096, merged=True) == 16  # Llama-3.1-8B's qkv: listed in ROWS_SHAPES
    assert linear_gemv_rows(4096, 1024 + 2048, merged=True) == 1  # Qwen3-0.6B's: not listed
    assert linear_gemv_rows(4096, 14336, merged=False) == MAX_M  # Llama-3.1-8B's down_proj: WIDE_ROWS_SHAPES


def test_multi_row_config_follows_the_sweep():
    """16 rows: 32-column tiles (64 where 64-wide tiles still give >= 2 x 132 programs), 4 stages; with
    SiLU-and-mul's two weight tiles 3, cut to 2 where 3 would pass the 160 KB shared-memory budget (the rule for
    shapes without a launch shape of their own: none listed here)."""
    from gyrfalcon.kernels.gemv import default_config
    assert tuple(default_config(16, 4096, 2048)) == (32, 256, 4, 4)
    assert tuple(default_config(16, 14336, 4096, silu_mul=True)) == (64, 256, 4, 2)
    assert tuple(default_config(16, 3072, 1024, silu_mul=True)) == (32, 256, 4, 3)
    assert tuple(default_config(16, 1024, 3072)) == (32, 256, 4, 4)


@pytest.mark.parametrize("M", [3, 33, 64])
@pytest.mark.parametrize("mode", ["plain", "norm+res", "norm+res+silu"])
def test_wide_row_tiles_match_unfused(M, mode):
    """Up to 64 rows in one tile (BLOCK_M 16 / 64)."""
    silu = mode.endswith("silu")
    x, r, w, nw = _data(M, 200, 48, torch.float32, silu)
    kw = dict(norm_weight=nw if mode != "plain" else None, residual=r if "res" in mode else None,
              eps=1e-6, silu_mul=silu)
    y_ref, r_ref = norm_gemv_ref(x, w, **kw)
    from gyrfalcon.kernels.gemv import GemvConfig
    y, r_new = norm_gemv_triton(x, w, config=GemvConfig(16, 32, 4, 2), **kw)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    if "res" in mode:
        torch.testing.assert_close(r_new, r_ref, rtol=0, atol=0)


def test_ref_against_naive_math():
    x, r, w, nw = _data(2, 8, 4, torch.float32, True)
    y, new_r = norm_gemv_ref(x, w, nw, r, 1e-6, silu_mul=True)
    h = x + r
    hn = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * nw
    gu = hn @ w.T
    torch.testing.assert_close(y, F.silu(gu[:, :4]) * gu[:, 4:])
    torch.testing.assert_close(new_r, h)


def test_rejects_too_many_rows_and_residual_without_norm():
    x, r, w, nw = _data(65, 32, 16, torch.float32, False)
    with pytest.raises(AssertionError, match="at most 64 rows"):
        norm_gemv_triton(x, w)
    with pytest.raises(ValueError, match="norm_weight"):
        norm_gemv_triton(x[:2], w, residual=r[:2])


def test_single_row_norm_over_a_row_longer_than_one_norm_block():
    """M = 1 reads the whole row in one norm block up to 8192 inputs; longer rows loop."""
    x, r, w, nw = _data(1, 9000, 8, torch.float32, False)
    y_ref, r_ref = norm_gemv_ref(x, w, nw, r, 1e-6)
    y, r_new = norm_gemv_triton(x, w, nw, r, 1e-6)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(r_new, r_ref, rtol=0, atol=0)


def test_peel_follows_pdl(monkeypatch):
    """PDL launches peel the first weight tile (with whole-row tiles); explicit peel= wins; without PDL nothing
    is peeled."""
    import sys

    mod = sys.modules[norm_gemv_triton.__module__]
    seen = []

    class _Record:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append((kw["PEEL"], kw["BLOCK_K"]))

    monkeypatch.setattr(mod, "_norm_gemv_kernel", _Record())
    x, w = torch.zeros(1, 3072), torch.zeros(1024, 3072, dtype=torch.bfloat16)
    x = x.to(torch.bfloat16)
    for pdl, peel, want in ((True, None, (True, 4096)), (True, False, (False, 1024)),
                            (False, None, (False, 1024))):
        seen.clear()
        norm_gemv_triton(x, w, pdl=pdl, peel=peel)
        assert seen == [want], (pdl, peel)


@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("one_pass", [False, True])
@pytest.mark.parametrize("peel", [False, True])
@pytest.mark.parametrize("mode", ["norm", "norm+res", "norm+res+silu"])
def test_one_pass_norm_matches_unfused(M, one_pass, peel, mode):
    """Rows with a norm: the rows' rstd applied after the loop (one pass over the input, the default for 2+
    rows, one_pass_norm_b1 for one) or from a first pass, with and without the peeled first tile."""
    silu = mode.endswith("silu")
    x, r, w, nw = _data(M, 200, 48, torch.float32, silu)
    kw = dict(norm_weight=nw, residual=r if "res" in mode else None, eps=1e-6, silu_mul=silu)
    y_ref, r_ref = norm_gemv_ref(x, w, **kw)
    y, r_new = norm_gemv_triton(x, w, block_n=16, block_k=32, peel=peel, one_pass=one_pass, **kw)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    if "res" in mode:
        torch.testing.assert_close(r_new, r_ref, rtol=0, atol=0)


def test_one_pass_norm_b1_rule():
    from gyrfalcon.kernels.gemv import one_pass_norm_b1

    # one tile spans a row of at most 1024 inputs
    assert one_pass_norm_b1(1024, 1024) and one_pass_norm_b1(200, 256)
    assert not one_pass_norm_b1(1024, 512) and not one_pass_norm_b1(4096, 4096)


@pytest.mark.parametrize("block_k,want", [(32, False), (256, True)])
def test_one_pass_norm_b1_reaches_the_launch(monkeypatch, block_k, want):
    """A single row's launch compiles ONE_PASS exactly when one tile spans the row (K = 200: block_k 256, not 32),
    and only with a norm; its output matches the reference either way."""
    import sys

    smg = sys.modules[norm_gemv_triton.__module__]
    x, r, w, nw = _data(1, 200, 48, torch.float32, True)
    spy = LaunchSpy(smg._norm_gemv_kernel, "ONE_PASS")
    seen = spy.seen
    monkeypatch.setattr(smg, "_norm_gemv_kernel", spy)
    kw = dict(norm_weight=nw, residual=r, eps=1e-6, silu_mul=True)
    y, _ = smg.norm_gemv_triton(x, w, block_n=16, block_k=block_k, **kw)
    smg.norm_gemv_triton(x, w, block_n=16, block_k=block_k)  # no norm: never ONE_PASS
    assert seen == [want, False]
    torch.testing.assert_close(y, norm_gemv_ref(x, w, **kw)[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("M", [1, 3, 16, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_to_adds_into_the_residual_in_place(M, dtype):
    """add_to (folded norms: o_proj / down_proj add into the residual stream): y = r + x W^T, in fp32 and
    rounded once, written into r itself."""
    from gyrfalcon.kernels.gemv import GemvConfig

    x, _, w, _ = _data(M, 200, 96, dtype, False)
    r = torch.randn(M, 96, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEV)
    want = (r.float() + x.float() @ w.float().t()).to(dtype)
    r0 = r.clone()
    cfg = GemvConfig(16, 32, 4, 2) if M > 1 else None
    y, _ = norm_gemv_triton(x, w, add_to=r, config=cfg)
    assert y.data_ptr() == r.data_ptr()
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(r, want, **tol)
    assert not torch.allclose(r.float(), r0.float())
    with pytest.raises(ValueError, match="plain GEMM"):
        norm_gemv_triton(x, w, norm_weight=torch.ones(200, dtype=dtype, device=DEV), add_to=r)


def test_b1_chain_shapes():
    """Single-row launch shapes: the chain-tuned table (B1_CHAIN_SHAPES) for peeled launches only; BLOCK_K still
    follows the whole-row rule."""
    from gyrfalcon.kernels.gemv import B1_CHAIN_SHAPES, default_config

    base = default_config(1, 4096, 1024)
    assert (base.block_n, base.num_warps) == (8, 8)  # not peeled: untouched
    tuned = default_config(1, 4096, 1024, whole_row=True)
    assert (tuned.block_n, tuned.num_warps) == B1_CHAIN_SHAPES[4096, 1024]
    gu = default_config(1, 3072, 1024, silu_mul=True, whole_row=True)
    assert (gu.block_n, gu.num_warps) == B1_CHAIN_SHAPES[3072, 1024]
    assert default_config(1, 1024, 3072, whole_row=True).block_k == 4096  # 4 x 4096 x 2 B fits the bound


def test_rows_shapes():
    """Launch shapes for 2-16 rows of Llama-3.1-8B's down_proj, qkv and o_proj (ROWS_SHAPES); single rows and more
    than 16 rows keep their defaults; a listed launch shape passed as config runs and matches the reference."""
    from gyrfalcon.kernels.gemv import ROWS_SHAPES, GemvConfig, default_config
    assert set(ROWS_SHAPES) == {(4096, 14336), (6144, 4096), (4096, 4096)}
    assert default_config(16, 4096, 14336) == GemvConfig(32, 512, 4, 4) == default_config(2, 4096, 14336)
    assert default_config(16, 6144, 4096) == GemvConfig(64, 128, 4, 6)
    assert default_config(1, 4096, 4096).block_n == 8 and default_config(33, 4096, 4096) != ROWS_SHAPES[4096, 4096]
    x, _, w, _ = _data(3, 200, 48, torch.float32, False)
    torch.testing.assert_close(norm_gemv_triton(x, w, config=GemvConfig(16, 32, 4, 2))[0], norm_gemv_ref(x, w)[0],
                               rtol=1e-4, atol=1e-4)


def test_launch_shapes_fit_a_smaller_card():
    """default_config's stages / BLOCK_K (listed launch shapes included) are cut to the device's shared memory a
    program (max_shared: sm_89's ~99 KB, A100's ~163 KB); at the H200's bound (the default) nothing changes."""
    from gyrfalcon.kernels.common import H200_MAX_SHARED
    from gyrfalcon.kernels.gemv import GemvConfig, default_config
    assert default_config(16, 4096, 14336, max_shared=H200_MAX_SHARED) == default_config(16, 4096, 14336) \
        == GemvConfig(32, 512, 4, 4)
    for smem in (99 * 1024, 163 * 1024):
        for M, N, K, silu in ((16, 4096, 14336, False), (16, 6144, 4096, False), (16, 1024, 3072, False),
                              (1, 14336, 4096, True), (64, 4096, 4096, False)):
            cfg = default_config(M, N, K, silu, max_shared=smem)
            tile = (max(cfg.block_n, 16 if M > 1 else cfg.block_n) * cfg.block_k * 2 * (2 if silu else 1)
                    + (max(16, M) * cfg.block_k * 2 if M > 16 or (N, K) in ((4096, 14336), (6144, 4096)) else 0))
            assert tile * cfg.num_stages <= smem - 7 * 1024, (smem, M, N, K, cfg)
    assert default_config(16, 4096, 14336, max_shared=99 * 1024).num_stages < 4


def test_wide_rows_shapes():
    """Launch shapes for 17-64 rows: Llama-3.1-8B's down_proj (WIDE_ROWS_SHAPES; 2-16 rows keep ROWS_SHAPES'
    entry); the kernel at 17 and 64 rows matches F.linear, its residual add (add_to) too."""
    from gyrfalcon.kernels.gemv import WIDE_ROWS_SHAPES, GemvConfig, default_config
    assert WIDE_ROWS_SHAPES == {(4096, 14336): GemvConfig(32, 256, 4, 4)}
    assert default_config(64, 4096, 14336) == GemvConfig(32, 256, 4, 4) == default_config(17, 4096, 14336)
    assert default_config(16, 4096, 14336) == GemvConfig(32, 512, 4, 4)
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(5)).to(DEV)
    for m in (17, 64):
        x = torch.randn(m, 64, generator=torch.Generator().manual_seed(m)).to(DEV)
        y, _ = norm_gemv_triton(x, w, config=GemvConfig(16, 32, 4, 2))
        torch.testing.assert_close(y, F.linear(x, w), rtol=1e-4, atol=1e-4)
        base = torch.randn(m, 96, generator=torch.Generator().manual_seed(m + 1)).to(DEV)
        got, _ = norm_gemv_triton(x, w, config=GemvConfig(16, 32, 4, 2), add_to=base.clone())
        torch.testing.assert_close(got, base + F.linear(x, w), rtol=1e-4, atol=1e-4)


def test_listed_shape_loses_stages_with_4_byte_weights():
    """A listed launch shape keeps its BLOCK_K but loses stages to the 220 KB shared-memory bound (weight and input
    tiles) where the weights are fp32 (twice the bytes the sweep timed)."""
    from gyrfalcon.kernels.gemv import GemvConfig, default_config
    assert default_config(16, 4096, 14336, elem_size=4) == GemvConfig(32, 512, 4, 2)  # 48 x 512 x 4 B x 2
