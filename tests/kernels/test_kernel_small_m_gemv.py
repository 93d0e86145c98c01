"""Fused [residual add +] RMSNorm -> GEMV -> [SiLU-and-mul] for decode-sized batches, against the
unfused composition of the references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gyrfalcon.kernels._common import next_pow2
from gyrfalcon.kernels.small_m_gemv import norm_gemv_ref, norm_gemv_triton
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


def test_whole_row_tiles_for_the_peeled_launch(monkeypatch):
    """By default (GYRFALCON_GEMV_WHOLE_ROW=0 turns it off) the PDL launch takes one tile over all of K (slices <= 64 KB, 16-bit
    weights), so that the whole weight slice loads before the wait; the plain launch keeps 1024-wide tiles."""
    from gyrfalcon.kernels.small_m_gemv import default_config
    monkeypatch.delenv("GYRFALCON_GEMV_WHOLE_ROW", raising=False)  # on by default
    assert default_config(1, 1024, 2048).block_k == 1024
    assert default_config(1, 1024, 2048, whole_row=True).block_k == 2048
    assert default_config(1, 1024, 3072, whole_row=True).block_k == 4096
    assert default_config(1, 1024, 1024, whole_row=True).block_k == 1024
    assert default_config(1, 4096, 14336, whole_row=True).block_k == 1024  # too long a row
    assert default_config(1, 14336, 4096, silu_mul=True, whole_row=True).block_k == 1024  # two 64 KB tiles
    assert default_config(1, 1024, 2048, elem_size=4, whole_row=True).block_k == 1024
    monkeypatch.setenv("GYRFALCON_GEMV_WHOLE_ROW", "0")
    assert default_config(1, 1024, 2048, whole_row=True).block_k == 1024


@pytest.mark.parametrize("mode", ["plain", "norm+res"])
def test_peeled_whole_row_launch_matches_unfused(mode, monkeypatch):
    """peel=True with the default config: K = 1500 in one 2048-wide tile (masked past K)."""
    monkeypatch.setenv("GYRFALCON_GEMV_WHOLE_ROW", "1")
    x, r, w, nw = _data(1, 1500, 24, torch.bfloat16, False)
    kw = dict(norm_weight=nw if mode != "plain" else None, residual=r if "res" in mode else None, eps=1e-6)
    y_ref, _ = norm_gemv_ref(x, w, **kw)
    y, _ = norm_gemv_triton(x, w, peel=True, **kw)
    torch.testing.assert_close(y, y_ref, rtol=3e-2, atol=3e-2)


def test_plain_rows_switch_routes_only_plain_linears(monkeypatch):
    """How many rows a norm-less Linear (o_proj, down_proj) sends through this kernel: 16 by default,
    GYRFALCON_SMALL_M_PLAIN_ROWS otherwise (at least 1, capped at MAX_M = 64); the merged projections (qkv,
    gate_up) keep single rows."""
    from gyrfalcon.kernels.small_m_gemv import GEMV_MAX_ROWS, PLAIN_MAX_ROWS, plain_gemm_max_rows
    from gyrfalcon.layers.linear import Linear, MergedLinear
    monkeypatch.delenv("GYRFALCON_SMALL_M_PLAIN_ROWS", raising=False)
    assert plain_gemm_max_rows() == PLAIN_MAX_ROWS == 16
    assert Linear(8, 4).small_m_rows == 16
    assert MergedLinear(8, {0: 4, 1: 4}).small_m_rows == GEMV_MAX_ROWS == 1
    monkeypatch.setenv("GYRFALCON_SMALL_M_PLAIN_ROWS", "1")
    assert plain_gemm_max_rows() == 1 and Linear(8, 4).small_m_rows == 1
    monkeypatch.setenv("GYRFALCON_SMALL_M_PLAIN_ROWS", "0")
    assert plain_gemm_max_rows() == 1
    monkeypatch.setenv("GYRFALCON_SMALL_M_PLAIN_ROWS", "64")
    assert plain_gemm_max_rows() == 64 and Linear(8, 4).small_m_rows == 64
    monkeypatch.setenv("GYRFALCON_SMALL_M_PLAIN_ROWS", "100")
    assert plain_gemm_max_rows() == 64
    assert MergedLinear(8, {0: 4, 1: 4}).small_m_rows == 1  # the plain-rows switch leaves qkv / gate_up alone


def test_multi_row_config_follows_the_sweep(monkeypatch):
    """16 rows: 32-column tiles (64 where 64-wide tiles still give >= 2 x 132 programs), 4 stages; with
    SiLU-and-mul's two weight tiles 3, cut to 2 where 3 would pass the 160 KB shared-memory budget (the rule for
    shapes without a launch shape of their own: none listed here)."""
    from gyrfalcon.kernels.small_m_gemv import default_config
    monkeypatch.setenv("GYRFALCON_GEMV_ROWS_SHAPES", "")
    assert tuple(default_config(16, 4096, 4096)) == (32, 256, 4, 4, 1)
    assert tuple(default_config(16, 14336, 4096, silu_mul=True)) == (64, 256, 4, 2, 1)
    assert tuple(default_config(16, 3072, 1024, silu_mul=True)) == (32, 256, 4, 3, 1)
    assert tuple(default_config(16, 1024, 3072)) == (32, 256, 4, 4, 1)


@pytest.mark.parametrize("M", [3, 33, 64])
@pytest.mark.parametrize("split_k", [1, 2, 3])
@pytest.mark.parametrize("mode", ["plain", "norm+res", "norm+res+silu"])
def test_split_k_and_wide_row_tiles_match_unfused(M, split_k, mode):
    """Up to 64 rows in one tile (BLOCK_M 16 / 64); K cut into split_k slices whose fp32 partials the last
    program of each column tile sums (K = 200 over 32-input tiles: slices of 96, 96, 8 at split 3; a
    split past the end of K adds zeros). Two launches in a row: the arrival counters are left at zero."""
    silu = mode.endswith("silu")
    x, r, w, nw = _data(M, 200, 48, torch.float32, silu)
    kw = dict(norm_weight=nw if mode != "plain" else None, residual=r if "res" in mode else None,
              eps=1e-6, silu_mul=silu)
    y_ref, r_ref = norm_gemv_ref(x, w, **kw)
    from gyrfalcon.kernels.small_m_gemv import GemvConfig
    for _ in range(2):
        y, r_new = norm_gemv_triton(x, w, config=GemvConfig(16, 32, 4, 2, split_k), **kw)
        torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
        if "res" in mode:
            torch.testing.assert_close(r_new, r_ref, rtol=0, atol=0)
    if split_k > 1:
        from gyrfalcon.kernels.small_m_gemv import _split_counters
        assert int(_split_counters(x.device, 1)[:8].abs().sum()) == 0


def test_split_k_config_switch(monkeypatch):
    """GYRFALCON_GEMV_SPLIT_K sets the default split for launches of more than 16 rows (1 by default), and
    the input tile counts against the shared-memory budget there (64 rows x 256 inputs: stages cut)."""
    from gyrfalcon.kernels.small_m_gemv import default_config
    monkeypatch.delenv("GYRFALCON_GEMV_SPLIT_K", raising=False)
    assert default_config(64, 4096, 4096).split_k == 1
    monkeypatch.setenv("GYRFALCON_GEMV_SPLIT_K", "2")
    assert default_config(64, 4096, 4096).split_k == 2 and default_config(16, 4096, 4096).split_k == 1
    assert tuple(default_config(64, 4096, 4096)) == (32, 256, 4, 3, 2)  # (32 + 64) x 256 x 2 B x 3 <= 160 KB


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


def test_peel_switch(monkeypatch):
    """GYRFALCON_GEMV_PEEL=0: PDL launches keep the early launch but do not peel the first weight tile (nor
    take whole-row tiles); explicit peel= wins; without PDL nothing is peeled."""
    import sys

    mod = sys.modules[norm_gemv_triton.__module__]
    seen = []

    class _Record:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append((kw["PEEL"], kw["BLOCK_K"]))

    monkeypatch.setattr(mod, "_norm_gemv_kernel", _Record())
    x, w = torch.zeros(1, 3072), torch.zeros(1024, 3072, dtype=torch.bfloat16)
    x = x.to(torch.bfloat16)
    for env, pdl, peel, want in (("1", True, None, (True, 4096)), ("0", True, None, (False, 1024)),
                                 ("0", True, True, (True, 4096)), ("1", False, None, (False, 1024))):
        monkeypatch.setenv("GYRFALCON_GEMV_PEEL", env)
        seen.clear()
        norm_gemv_triton(x, w, pdl=pdl, peel=peel)
        assert seen == [want], (env, pdl, peel)


@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("one_pass", [False, True])
@pytest.mark.parametrize("peel", [False, True])
@pytest.mark.parametrize("mode", ["norm", "norm+res", "norm+res+silu"])
def test_one_pass_norm_matches_unfused(M, one_pass, peel, mode):
    """Rows with a norm: the rows' rstd applied after the loop (one pass over the input, the default for 2+
    rows, GYRFALCON_GEMV_ONE_PASS_NORM_B1=1 for one) or from a first pass (GYRFALCON_GEMV_ONE_PASS_NORM=0),
    with and without the peeled first tile."""
    silu = mode.endswith("silu")
    x, r, w, nw = _data(M, 200, 48, torch.float32, silu)
    kw = dict(norm_weight=nw, residual=r if "res" in mode else None, eps=1e-6, silu_mul=silu)
    y_ref, r_ref = norm_gemv_ref(x, w, **kw)
    y, r_new = norm_gemv_triton(x, w, block_n=16, block_k=32, peel=peel, one_pass=one_pass, **kw)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    if "res" in mode:
        torch.testing.assert_close(r_new, r_ref, rtol=0, atol=0)


def test_one_pass_norm_switch(monkeypatch):
    from gyrfalcon.kernels.small_m_gemv import one_pass_norm_b1, one_pass_norm_default

    monkeypatch.delenv("GYRFALCON_GEMV_ONE_PASS_NORM", raising=False)
    monkeypatch.delenv("GYRFALCON_GEMV_ONE_PASS_NORM_B1", raising=False)
    # auto: one tile spans a row of at most 1024 inputs
    assert one_pass_norm_default() and one_pass_norm_b1(1024, 1024) and one_pass_norm_b1(200, 256)
    assert not one_pass_norm_b1(1024, 512) and not one_pass_norm_b1(4096, 4096)
    monkeypatch.setenv("GYRFALCON_GEMV_ONE_PASS_NORM", "0")
    monkeypatch.setenv("GYRFALCON_GEMV_ONE_PASS_NORM_B1", "1")
    assert not one_pass_norm_default() and one_pass_norm_b1(1024, 512) and one_pass_norm_b1(4096, 4096)
    monkeypatch.setenv("GYRFALCON_GEMV_ONE_PASS_NORM_B1", "0")
    assert not one_pass_norm_b1(1024, 1024)


@pytest.mark.parametrize("env,block_k,want", [(None, 32, False), (None, 256, True), ("0", 256, False),
                                              ("1", 32, True)])
def test_one_pass_norm_b1_switch_reaches_the_launch(monkeypatch, env, block_k, want):
    """A single row's launch compiles ONE_PASS when GYRFALCON_GEMV_ONE_PASS_NORM_B1 says so: by default exactly
    when one tile spans the row (K = 200: block_k 256, not 32), and only with a norm; its output matches the
    reference either way."""
    import gyrfalcon.kernels.small_m_gemv as smg

    if env is None:
        monkeypatch.delenv("GYRFALCON_GEMV_ONE_PASS_NORM_B1", raising=False)
    else:
        monkeypatch.setenv("GYRFALCON_GEMV_ONE_PASS_NORM_B1", env)
    x, r, w, nw = _data(1, 200, 48, torch.float32, True)
    spy = LaunchSpy(smg._norm_gemv_kernel, "ONE_PASS")
    seen = spy.seen
    monkeypatch.setattr(smg, "_norm_gemv_kernel", spy)
    kw = dict(norm_weight=nw, residual=r, eps=1e-6, silu_mul=True)
    y, _ = smg.norm_gemv_triton(x, w, block_n=16, block_k=block_k, **kw)
    smg.norm_gemv_triton(x, w, block_n=16, block_k=block_k)  # no norm: never ONE_PASS
    assert seen == [want, False]
    torch.testing.assert_close(y, norm_gemv_ref(x, w, **kw)[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("M,split_k", [(1, 1), (3, 1), (16, 1), (33, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_to_adds_into_the_residual_in_place(M, split_k, dtype):
    """add_to (folded norms: o_proj / down_proj add into the residual stream): y = r + x W^T, in fp32 and
    rounded once, written into r itself (with split-K, by the last program of each column tile)."""
    from gyrfalcon.kernels.small_m_gemv import GemvConfig

    x, _, w, _ = _data(M, 200, 96, dtype, False)
    r = torch.randn(M, 96, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEV)
    want = (r.float() + x.float() @ w.float().t()).to(dtype)
    r0 = r.clone()
    cfg = GemvConfig(16, 32, 4, 2, split_k) if M > 1 else None
    y, _ = norm_gemv_triton(x, w, add_to=r, config=cfg)
    assert y.data_ptr() == r.data_ptr()
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(r, want, **tol)
    assert not torch.allclose(r.float(), r0.float())
    with pytest.raises(ValueError, match="plain GEMM"):
        norm_gemv_triton(x, w, norm_weight=torch.ones(200, dtype=dtype, device=DEV), add_to=r)


def test_gemv_chain_sweep_benchmark_configs_and_chain():
    """benchmarks/small_m_gemv.py --gemv-chain-sweep: its launch shapes differ from each GEMV's default in BLOCK_N or
    warps only, span the row where the whole-row bound allows (else 1024 inputs), and the layer chain run with one
    GEMV at another shape (small, under the interpreter) matches the all-default chain."""
    from benchmark_scripts import load_benchmark

    from gyrfalcon.kernels.small_m_gemv import WHOLE_ROW_MAX_BYTES

    bench = load_benchmark("small_m_gemv")
    full = bench.QwenB1Chain.__new__(bench.QwenB1Chain)  # the real Qwen3-0.6B dims, no tensors
    cfgs = bench.chain_gemv_configs(full)
    assert {k[0] for k in cfgs} == {"qkv", "o", "gu", "down"} and len(cfgs) == 4 * 15  # 16 shapes, one the default
    for (name, bn, warps), cfg in cfgs.items():
        assert (cfg.block_n, cfg.num_warps) == (bn, warps)
        K = {"qkv": 1024, "o": 2048, "gu": 1024, "down": 3072}[name]
        slice_bytes = bn * next_pow2(K) * 2 * (2 if name == "gu" else 1)
        assert cfg.block_k == (next_pow2(K) if slice_bytes <= WHOLE_ROW_MAX_BYTES else min(1024, next_pow2(K)))
    c = bench.QwenB1Chain(device=DEV, dtype=torch.float32, H=2, KV=1, D=16, hid=64, inter=96, layers=2, ctx=20)
    small = bench.chain_gemv_configs(c)
    ref = c.step(c.distinct, False)
    assert float(ref.abs().max()) > 1e-3  # not a chain of zeros
    for key in (("qkv", 8, 2), ("o", 16, 1), ("gu", 2, 8), ("down", 2, 2)):
        got = c.step(c.distinct, False, gemv={key[0]: small[key]})
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_b1_shape_overrides(monkeypatch):
    """Single-row launch shapes: by default the chain-tuned table (B1_CHAIN_SHAPES) for peeled launches only;
    GYRFALCON_GEMV_B1_SHAPES replaces it for every single-row launch ("" = none) and only for the listed (N, K);
    BLOCK_K still follows the whole-row rule; malformed entries are refused with the variable's name."""
    from gyrfalcon.kernels.small_m_gemv import B1_CHAIN_SHAPES, b1_shape_overrides, default_config

    monkeypatch.setenv("GYRFALCON_GEMV_B1_SHAPES", "")
    assert b1_shape_overrides() == {}
    base = default_config(1, 4096, 1024)
    plain, rows16 = default_config(1, 2048, 1024), default_config(16, 4096, 1024)
    assert (base.block_n, base.num_warps) == (8, 8)
    monkeypatch.delenv("GYRFALCON_GEMV_B1_SHAPES")
    assert b1_shape_overrides() == B1_CHAIN_SHAPES and b1_shape_overrides(whole_row=False) == {}
    assert default_config(1, 4096, 1024) == base  # not peeled: untouched
    tuned = default_config(1, 4096, 1024, whole_row=True)
    assert (tuned.block_n, tuned.num_warps) == B1_CHAIN_SHAPES[4096, 1024]
    gu = default_config(1, 3072, 1024, silu_mul=True, whole_row=True)
    assert (gu.block_n, gu.num_warps) == B1_CHAIN_SHAPES[3072, 1024]
    monkeypatch.setenv("GYRFALCON_GEMV_B1_SHAPES", "4096x1024=16,4; 1024x3072=4,2")
    assert b1_shape_overrides() == {(4096, 1024): (16, 4), (1024, 3072): (4, 2)}
    got = default_config(1, 4096, 1024)
    assert (got.block_n, got.num_warps, got.block_k) == (16, 4, base.block_k)
    assert default_config(1, 1024, 3072, whole_row=True).block_k == 4096  # 4 x 4096 x 2 B fits the bound
    # shapes not listed, and launches of 2+ rows, keep their defaults
    assert default_config(1, 2048, 1024) == plain and default_config(16, 4096, 1024) == rows16
    for bad in ("4096x1024=16", "4096=16,4", "4096x1024=12,4", "4096x1024=16,3"):
        monkeypatch.setenv("GYRFALCON_GEMV_B1_SHAPES", bad)
        with pytest.raises(ValueError, match="GYRFALCON_GEMV_B1_SHAPES"):
            b1_shape_overrides()


def test_rows_shape_overrides(monkeypatch):
    """Launch shapes for 2-16 rows: none by default (ROWS_SHAPES); GYRFALCON_GEMV_ROWS_SHAPES sets them per (N, K),
    split-K included, for 2..PLAIN_MAX_ROWS rows only ("" = none); malformed entries are refused by name. A
    MergedLinear of a listed shape (qkv here) leaves cuBLAS for the GEMV up to plain_gemm_max_rows rows, the others
    keep single rows; a listed shape runs its launch shape and matches the reference, split-K too."""
    from gyrfalcon.kernels.small_m_gemv import (ROWS_SHAPES, GemvConfig, default_config, norm_gemv_ref,
                                                norm_gemv_triton, rows_shape_overrides)
    from gyrfalcon.layers.linear import Linear, MergedLinear
    monkeypatch.delenv("GYRFALCON_GEMV_ROWS_SHAPES", raising=False)
    monkeypatch.delenv("GYRFALCON_SMALL_M_PLAIN_ROWS", raising=False)
    # by default Llama-3.1-8B's down_proj, qkv (off cuBLAS) and o_proj (run 83's sweep)
    assert rows_shape_overrides() == ROWS_SHAPES and set(ROWS_SHAPES) == {(4096, 14336), (6144, 4096), (4096, 4096)}
    assert default_config(16, 4096, 14336) == GemvConfig(32, 512, 4, 4, 1)
    assert MergedLinear(4096, {"q": 4096, "k": 1024, "v": 1024}).small_m_rows == 16
    assert MergedLinear(1024, {"q": 2048, "k": 1024, "v": 1024}).small_m_rows == 1  # Qwen3-0.6B's: not listed
    monkeypatch.setenv("GYRFALCON_GEMV_ROWS_SHAPES", "")
    base16, base1, base33 = default_config(16, 4096, 4096), default_config(1, 4096, 4096), default_config(33, 4096, 4096)
    assert MergedLinear(4096, {"q": 4096, "k": 1024, "v": 1024}).small_m_rows == 1
    monkeypatch.setenv("GYRFALCON_GEMV_ROWS_SHAPES", "4096x4096=64,128,8,6,2; 6144x4096=16,512,4,4")
    assert rows_shape_overrides() == {(4096, 4096): GemvConfig(64, 128, 8, 6, 2), (6144, 4096): GemvConfig(16, 512, 4, 4, 1)}
    assert default_config(16, 4096, 4096) == GemvConfig(64, 128, 8, 6, 2) == default_config(2, 4096, 4096)
    # single rows, more than 16 rows and unlisted shapes keep their defaults
    assert default_config(1, 4096, 4096) == base1 and default_config(33, 4096, 4096) == base33
    assert default_config(16, 4096, 14336) == default_config(16, 4096, 14336, elem_size=2)
    assert MergedLinear(4096, {"q": 4096, "k": 1024, "v": 1024}).small_m_rows == 16
    assert MergedLinear(4096, {0: 14336, 1: 14336}).small_m_rows == 1
    assert Linear(4096, 4096).small_m_rows == 16
    monkeypatch.setenv("GYRFALCON_GEMV_ROWS_SHAPES", "")
    assert rows_shape_overrides() == {} and default_config(16, 4096, 4096) == base16
    for bad in ("4096x4096=64,128,8", "4096=64,128,8,6", "4096x4096=48,128,8,6", "4096x4096=64,128,3,6",
                "4096x4096=64,128,8,6,0", "4096x4096=64,128,8,6,2,1"):
        monkeypatch.setenv("GYRFALCON_GEMV_ROWS_SHAPES", bad)
        with pytest.raises(ValueError, match="GYRFALCON_GEMV_ROWS_SHAPES"):
            rows_shape_overrides()
    # the launch takes it: 3 rows over K = 200, split 3 ways (its own launch shape, no config passed)
    x, _, w, _ = _data(3, 200, 48, torch.float32, False)
    monkeypatch.setenv("GYRFALCON_GEMV_ROWS_SHAPES", "48x200=16,32,4,2,3")
    assert default_config(3, 48, 200).split_k == 3
    torch.testing.assert_close(norm_gemv_triton(x, w)[0], norm_gemv_ref(x, w)[0], rtol=1e-4, atol=1e-4)


def test_launch_shapes_fit_a_smaller_card(monkeypatch):
    """default_config's stages / BLOCK_K (listed launch shapes included) are cut to the device's shared memory a
    program (max_shared: sm_89's ~99 KB, A100's ~163 KB); at the H200's bound (the default) nothing changes."""
    from gyrfalcon.kernels._common import H200_MAX_SHARED
    from gyrfalcon.kernels.small_m_gemv import GemvConfig, default_config
    monkeypatch.delenv("GYRFALCON_GEMV_ROWS_SHAPES", raising=False)
    assert default_config(16, 4096, 14336, max_shared=H200_MAX_SHARED) == default_config(16, 4096, 14336) \
        == GemvConfig(32, 512, 4, 4, 1)
    for smem in (99 * 1024, 163 * 1024):
        for M, N, K, silu in ((16, 4096, 14336, False), (16, 6144, 4096, False), (16, 1024, 3072, False),
                              (1, 14336, 4096, True), (64, 4096, 4096, False)):
            cfg = default_config(M, N, K, silu, max_shared=smem)
            tile = (max(cfg.block_n, 16 if M > 1 else cfg.block_n) * cfg.block_k * 2 * (2 if silu else 1)
                    + (max(16, M) * cfg.block_k * 2 if M > 16 or (N, K) in ((4096, 14336), (6144, 4096)) else 0))
            assert tile * cfg.num_stages <= smem - 7 * 1024, (smem, M, N, K, cfg)
    assert default_config(16, 4096, 14336, max_shared=99 * 1024).num_stages < 4


def test_wide_rows_shape_overrides(monkeypatch):
    """Launch shapes for 17-64 rows: Llama-3.1-8B's down_proj by default (WIDE_ROWS_SHAPES; "" empties the list);
    GYRFALCON_GEMV_WIDE_ROWS_SHAPES lists them
    per (N, K) and a linear layer of a listed shape (a MergedLinear too) then runs on the GEMV kernel up to MAX_M
    rows instead of cuBLAS, at that launch shape (2-16 rows keep theirs); the layer matches F.linear at 17 and 64
    rows, its residual add (add_to) too."""
    import torch.nn.functional as F

    from gyrfalcon.kernels.small_m_gemv import (MAX_M, WIDE_ROWS_SHAPES, GemvConfig, default_config,
                                                wide_rows_shape_overrides)
    from gyrfalcon.layers.linear import Linear, MergedLinear
    monkeypatch.delenv("GYRFALCON_GEMV_WIDE_ROWS_SHAPES", raising=False)
    monkeypatch.delenv("GYRFALCON_GEMV_ROWS_SHAPES", raising=False)
    monkeypatch.delenv("GYRFALCON_SMALL_M_PLAIN_ROWS", raising=False)
    assert WIDE_ROWS_SHAPES == {(4096, 14336): GemvConfig(32, 256, 4, 4, 1)} == wide_rows_shape_overrides()
    assert Linear(14336, 4096).small_m_rows == MAX_M and Linear(4096, 4096).small_m_rows == 16
    assert default_config(64, 4096, 14336) == GemvConfig(32, 256, 4, 4, 1)
    monkeypatch.setenv("GYRFALCON_GEMV_WIDE_ROWS_SHAPES", "")  # none: cuBLAS above 16 rows
    assert wide_rows_shape_overrides() == {} and Linear(14336, 4096).small_m_rows == 16
    base64, base16 = default_config(64, 4096, 14336), default_config(16, 4096, 14336)
    monkeypatch.setenv("GYRFALCON_GEMV_WIDE_ROWS_SHAPES", "4096x14336=32,256,4,4; 96x64=16,32,4,2,2")
    assert wide_rows_shape_overrides() == {(4096, 14336): GemvConfig(32, 256, 4, 4, 1),
                                           (96, 64): GemvConfig(16, 32, 4, 2, 2)}
    assert default_config(64, 4096, 14336) == GemvConfig(32, 256, 4, 4, 1) == default_config(17, 4096, 14336)
    assert base64 != GemvConfig(32, 256, 4, 4, 1)
    assert default_config(16, 4096, 14336) == base16  # 2-16 rows: ROWS_SHAPES' entry
    assert Linear(14336, 4096).small_m_rows == MAX_M == 64
    assert Linear(4096, 4096).small_m_rows == 16  # not listed
    assert MergedLinear(64, {0: 48, 1: 48}).small_m_rows == 64
    monkeypatch.setenv("GYRFALCON_GEMV_WIDE_ROWS_SHAPES", "4096x14336=32,256,4")
    with pytest.raises(ValueError, match="GYRFALCON_GEMV_WIDE_ROWS_SHAPES"):
        wide_rows_shape_overrides()
    # The layer's forward takes the kernel (split-K 2) at 17 and 64 rows and matches F.linear, with add_to too
    # (use_triton stubbed: off CUDA the layer would keep F.linear; the interpreter runs the kernel on CPU tensors).
    import sys

    import gyrfalcon.layers.linear as linear_mod
    monkeypatch.setenv("GYRFALCON_GEMV_WIDE_ROWS_SHAPES", "96x64=16,32,4,2,2")
    monkeypatch.setattr(linear_mod, "use_triton", lambda t: True)
    lin = Linear(64, 96)
    lin.weight.data = torch.randn(96, 64, generator=torch.Generator().manual_seed(5))
    gm = sys.modules["gyrfalcon.kernels.small_m_gemv"]
    spy = LaunchSpy(gm._norm_gemv_kernel, "SPLIT_K")
    monkeypatch.setattr(gm, "_norm_gemv_kernel", spy)
    for m in (17, 64):
        x = torch.randn(m, 64, generator=torch.Generator().manual_seed(m))
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight), rtol=1e-4, atol=1e-4)
        base = torch.randn(m, 96, generator=torch.Generator().manual_seed(m + 1))
        want = base + F.linear(x, lin.weight)
        torch.testing.assert_close(lin(x, add_to=base.clone()), want, rtol=1e-4, atol=1e-4)
    assert spy.seen == [2, 2, 2, 2]
    x = torch.randn(65, 64)  # past MAX_M: F.linear, no launch
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight))
    assert len(spy.seen) == 4


def test_listed_shape_loses_stages_with_4_byte_weights(monkeypatch):
    """A listed launch shape keeps its split and BLOCK_K but loses stages to the 220 KB shared-memory bound (weight
    and input tiles) where the weights are fp32 (twice the bytes the sweep timed)."""
    from gyrfalcon.kernels.small_m_gemv import GemvConfig, default_config
    monkeypatch.setenv("GYRFALCON_GEMV_ROWS_SHAPES", "4096x14336=32,512,4,4,2")
    assert default_config(16, 4096, 14336) == GemvConfig(32, 512, 4, 4, 2)
    assert default_config(16, 4096, 14336, elem_size=4) == GemvConfig(32, 512, 4, 2, 2)  # 48 x 512 x 4 B x 2


def test_wide_sweep_configs_fit_shared_memory():
    """benchmarks/small_m_gemv.py --wide at 2-16 rows: split-K 1 / 2 / 4, 8 warps and 6 stages among the launch
    shapes, each within ~220 KB of weight + input tiles; at 64 rows 256-input steps and 8 warps, within the same
    bound with the 64-row input tile; without --wide the old grids."""
    from benchmark_scripts import load_benchmark
    bench = load_benchmark("small_m_gemv")
    wide = list(bench.sweep_configs(16, wide=True))
    assert {c.split_k for c in wide} == {1, 2, 4} and {c.num_warps for c in wide} == {4, 8}
    assert max(c.num_stages for c in wide) == 6 and {c.block_k for c in wide} == {128, 256, 512}
    assert all((c.block_n + 16) * c.block_k * 2 * c.num_stages <= 220 * 1024 for c in wide)
    assert len(wide) == len(set(wide)) > 50
    assert list(bench.sweep_configs(16)) == list(bench.sweep_configs(16, wide=False))
    assert all(c.split_k == 1 and c.num_warps == 4 for c in bench.sweep_configs(16))
    w64 = list(bench.sweep_configs(64, wide=True))
    assert {c.block_k for c in w64} == {64, 128, 256} and {c.num_warps for c in w64} == {4, 8}
    assert all((c.block_n + 64) * c.block_k * 2 * c.num_stages <= 220 * 1024 for c in w64)
    assert not any(c.block_k == 256 or c.num_warps == 8 for c in bench.sweep_configs(64))  # the old grid had neither


def test_chain_env_benchmark_sets_each_value():
    """benchmarks/small_m_gemv.py --chain-env: every value (and unset) is in force while its chain runs and is
    timed, in alternating rounds; one row a value with its output's distance from the unset chain's (small chain,
    interpreter, a stand-in timer that records the variable instead of timing)."""
    import os

    from benchmark_scripts import load_benchmark

    bench = load_benchmark("small_m_gemv")
    c = bench.QwenB1Chain(device=DEV, dtype=torch.float32, H=2, KV=1, D=16, hid=64, inter=96, layers=1, ctx=20)
    seen = []

    def timer(step):
        seen.append(os.environ.get("GYRFALCON_DECODE_REDUCE_WARPS"))
        step()
        return 10.0 + len(seen)

    rows = []
    bench.bench_chain_env(rows, "GYRFALCON_DECODE_REDUCE_WARPS=1/8", rounds=2, chain=c, timer=timer, pdl=False)
    assert seen == [None, "1", "8", "8", "1", None]
    assert [r["value"] for r in rows] == ["unset", "1", "8"]
    assert all(r["max_abs_diff"] < 1e-4 for r in rows) and rows[0]["speedup_vs_unset"] == 1.0


def test_chain_env_benchmark_skips_a_failing_value():
    """A value whose chain raises (a launch shape that does not compile) is reported and left out of the timing."""
    from benchmark_scripts import load_benchmark

    bench = load_benchmark("small_m_gemv")

    class Chain:
        layers, ctx, distinct = 1, 8, None

        def step(self, Ws, pdl):
            import os
            if os.environ.get("GYRFALCON_DECODE_REDUCE_WARPS") == "3":
                raise ValueError("no such launch")
            return torch.zeros(1, 4)

    rows = []
    bench.bench_chain_env(rows, "GYRFALCON_DECODE_REDUCE_WARPS=3/2", rounds=2, chain=Chain(),
                          timer=lambda step: (step(), 5.0)[1], pdl=False)
    assert [r["value"] for r in rows] == ["3", "unset", "2"] and "no such launch" in rows[0]["error"]
    assert rows[1]["us_median"] == 5.0 and rows[2]["max_abs_diff"] == 0.0
