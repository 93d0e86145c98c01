"""The fused-MoE Triton op (sort + grouped gate_up GEMM with SiLU-and-mul + grouped down GEMM + top-k sum) against
the loop-over-experts reference, under TRITON_INTERPRET=1 at small shapes (compiled on a GPU)."""

from __future__ import annotations

import pytest
import torch

from kernels_testutil import HAS_CUDA, requires_triton

from gyrfalcon.kernels.fused_moe import fused_moe, fused_moe_ref, fused_moe_triton, moe_align
from gyrfalcon.kernels.fused_moe.configs import GemmTile, MoeConfig, default_config
from gyrfalcon.kernels.fused_moe.triton import max_sorted_rows

DEV = "cuda" if HAS_CUDA else "cpu"
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _weights(E, H, I, dtype, seed):  # noqa: E741
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(dtype).to(DEV)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dtype).to(DEV)
    return g, w13, w2


def _routing(T, E, k, mode, g):
    """topk_ids [T, k] (distinct per row) and topk_weights [T, k] fp32 for a load pattern:
    random: uniform; skewed: experts drawn with weights 1, 1/2, 1/3, ... (uneven loads, the tail mostly empty);
    low_only: only experts 0..k (every other expert empty); all_one: expert E-1 in every row (with k = 1 it gets
    every pair)."""
    if mode == "random":
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    elif mode == "skewed":
        p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 2
        ids = torch.stack([torch.multinomial(p, k, replacement=False, generator=g) for _ in range(T)])
    elif mode == "low_only":
        ids = torch.stack([torch.randperm(k + 1, generator=g)[:k] for _ in range(T)])
    elif mode == "all_one":
        rest = [torch.randperm(E - 1, generator=g)[: k - 1] for _ in range(T)]
        ids = torch.stack([torch.cat([torch.tensor([E - 1]), r]) for r in rest])
    else:
        raise ValueError(mode)
    w = torch.softmax(torch.randn(T, k, generator=g), dim=-1).float()
    return w.to(DEV), ids.to(DEV)


def _check(T, E, k, H, I, dtype, mode, config=None, id_dtype=torch.int64):  # noqa: E741
    g, w13, w2 = _weights(E, H, I, dtype, seed=T * 100 + E * 10 + k)
    x = torch.randn(T, H, generator=g).to(dtype).to(DEV)
    tw, ids = _routing(T, E, k, mode, g)
    ids = ids.to(id_dtype)
    want = fused_moe_ref(x, w13, w2, tw, ids)
    got = fused_moe_triton(x, w13, w2, tw, ids, config=config)
    assert got.shape == (T, H) and got.dtype == dtype
    torch.testing.assert_close(got, want, **TOL[dtype])


@requires_triton
@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_routing(T, k, dtype):
    _check(T, 8, k, 32, 16, dtype, "random")


@requires_triton
@pytest.mark.parametrize("mode", ["skewed", "low_only", "all_one"])
@pytest.mark.parametrize("T,k", [(1, 1), (3, 4), (17, 2), (17, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_uneven_and_empty_experts(mode, T, k, dtype):
    _check(T, 8, k, 48, 24, dtype, mode)


@requires_triton
@pytest.mark.parametrize("k", [1, 3, 4])
def test_top_k_equals_num_experts_and_ragged_shapes(k):
    """k = E (every expert gets every token), H and I not multiples of the tiles (masked edges), int32 ids."""
    _check(5, k, k, 40, 20, torch.float32, "random", id_dtype=torch.int32)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_expert_gets_every_pair_over_several_tiles(dtype):
    """T = 37 > BLOCK_M = 16: expert 5's pairs span three tiles, the last one partly padding; K and N loop over
    several tiles (BLOCK_K = BLOCK_N = 16 against H = 64, I = 48)."""
    cfg = MoeConfig(16, GemmTile(16, 16, 4, 1), GemmTile(16, 16, 4, 1))
    g, w13, w2 = _weights(6, 64, 48, dtype, seed=7)
    x = torch.randn(37, 64, generator=g).to(dtype).to(DEV)
    ids = torch.full((37, 1), 5, dtype=torch.int64, device=DEV)
    tw = torch.rand(37, 1, generator=g).float().to(DEV)
    want = fused_moe_ref(x, w13, w2, tw, ids)
    torch.testing.assert_close(fused_moe_triton(x, w13, w2, tw, ids, config=cfg), want, **TOL[dtype])


@requires_triton
@pytest.mark.parametrize("block_m", [16, 32])
def test_small_tiles_many_experts(block_m):
    """Block shapes below the problem's (several N and K steps) and a 32-row tile, 17 tokens over 8 experts."""
    cfg = MoeConfig(block_m, GemmTile(16, 16, 4, 1), GemmTile(16, 32, 4, 1))
    g, w13, w2 = _weights(8, 64, 48, torch.float32, seed=3)
    x = torch.randn(17, 64, generator=g).to(DEV)
    tw, ids = _routing(17, 8, 3, "skewed", g)
    want = fused_moe_ref(x, w13, w2, tw, ids)
    torch.testing.assert_close(fused_moe_triton(x, w13, w2, tw, ids, config=cfg), want, **TOL[torch.float32])


@requires_triton
def test_deterministic():
    g, w13, w2 = _weights(8, 32, 16, torch.bfloat16, seed=1)
    x = torch.randn(17, 32, generator=g).to(torch.bfloat16).to(DEV)
    tw, ids = _routing(17, 8, 4, "random", g)
    a = fused_moe_triton(x, w13, w2, tw, ids)
    b = fused_moe_triton(x, w13, w2, tw, ids)
    assert torch.equal(a, b)


ALIGN_PATHS = [pytest.param(True, marks=requires_triton, id="kernel"), pytest.param(False, id="torch")]


@pytest.mark.parametrize("one_launch", ALIGN_PATHS)
def test_align_groups_pads_and_marks_tiles(one_launch):
    """moe_align's layout: each expert's pairs in pair order from a multiple of BLOCK_M, padding P, tiles past the
    used rows marked -1; empty experts own no tile."""
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]], device=DEV)  # P = 6; expert 1 empty
    sorted_ids, tile_expert = moe_align(ids, 5, 4, one_launch=one_launch)
    assert sorted_ids.numel() == max_sorted_rows(6, 5, 4) == 4 * tile_expert.numel()
    P = 6
    want_rows = [1, 4, P, P, 0, 2, 5, P, 3, P, P, P]  # expert 0: pairs 1, 4; expert 2: 0, 2, 5; expert 3: 3
    assert sorted_ids[:12].tolist() == want_rows
    assert (sorted_ids[12:] == P).all()
    assert tile_expert[:3].tolist() == [0, 2, 3]
    assert (tile_expert[3:] == -1).all()


@requires_triton
@pytest.mark.parametrize("T,E,k,block_m", [(1, 128, 8, 16), (17, 8, 3, 16), (40, 256, 8, 16), (33, 6, 6, 32),
                                           (5, 4, 1, 64)])
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_align_kernel_matches_torch(T, E, k, block_m, id_dtype):
    """The single-program sort kernel (decode batches) and the torch sort give the same layout, bit for bit: several
    chunks of pairs (40 x 8 = 320 pairs in chunks of 16 at E = 256), many tiles, skewed loads."""
    g = torch.Generator().manual_seed(T * E)
    p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64)
    ids = torch.stack([torch.multinomial(p, k, replacement=False, generator=g) for _ in range(T)]).to(id_dtype)
    ids = ids.to(DEV)
    a = moe_align(ids, E, block_m, one_launch=True)
    b = moe_align(ids, E, block_m, one_launch=False)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("one_launch", ALIGN_PATHS)
def test_align_bound_is_tight_for_decode(one_launch):
    """A batch-1 decode step (8 pairs over 128 experts) sizes its grid by its 8 experts, not all 128."""
    ids = torch.randperm(128)[:8][None].to(DEV)
    _, tile_expert = moe_align(ids, 128, 16, one_launch=one_launch)
    assert tile_expert.numel() == 8 and (tile_expert >= 0).all()
    assert sorted(tile_expert.tolist()) == sorted(ids[0].tolist())


def test_default_config_shapes():
    cfg = default_config(8, 128, 2048, 768)
    assert cfg.block_m == 16  # decode: one row per selected expert
    assert default_config(256 * 8, 8, 2048, 768).block_m == 64  # a prefill over few experts fills big tiles
    small = default_config(17, 8, 32, 16)
    assert small.up.block_n == 16 and small.up.block_k == 32 and small.down.block_n == 32 and small.down.block_k == 16


def test_dispatcher_routes_cpu_to_reference(monkeypatch):
    import gyrfalcon.kernels.fused_moe as pkg
    called = []
    monkeypatch.setattr(pkg, "fused_moe_triton", lambda *a, **kw: called.append(1))
    g, w13, w2 = _weights(4, 32, 16, torch.float32, seed=2)
    x = torch.randn(3, 32, generator=g)
    tw, ids = _routing(3, 4, 2, "random", g)
    w13, w2, tw, ids = w13.cpu(), w2.cpu(), tw.cpu(), ids.cpu()
    out = pkg.fused_moe(x, w13, w2, tw, ids)
    assert not called
    torch.testing.assert_close(out, fused_moe_ref(x, w13, w2, tw, ids), rtol=0, atol=0)
    assert fused_moe is pkg.fused_moe


@requires_triton
@pytest.mark.parametrize("T,k", [(1, 2), (3, 1)])
def test_unselected_experts_are_never_used(T, k):
    """NaN in every expert no pair selected leaves the output finite and equal to the reference's: padding rows and
    tiles past the used ones contribute nothing from other experts' weights."""
    g, w13, w2 = _weights(8, 32, 16, torch.float32, seed=11)
    x = torch.randn(T, 32, generator=g).to(DEV)
    tw, ids = _routing(T, 8, k, "random", g)
    unused = torch.ones(8, dtype=torch.bool)
    unused[ids.reshape(-1).cpu()] = False
    w13p, w2p = w13.clone(), w2.clone()
    w13p[unused.to(DEV)] = float("nan")
    w2p[unused.to(DEV)] = float("nan")
    got = fused_moe_triton(x, w13p, w2p, tw, ids)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, fused_moe_ref(x, w13, w2, tw, ids), **TOL[torch.float32])


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_sized_batch_takes_the_torch_sort(dtype):
    """40 tokens x k 8 = 320 pairs > ALIGN_KERNEL_MAX_PAIRS: the op sorts with torch ops, same result."""
    from gyrfalcon.kernels.fused_moe.configs import ALIGN_KERNEL_MAX_PAIRS
    assert 40 * 8 > ALIGN_KERNEL_MAX_PAIRS
    _check(40, 16, 8, 32, 16, dtype, "skewed")
