"""The fused-MoE Triton op (sort + grouped gate_up GEMM with SiLU-and-mul + grouped down GEMM + top-k sum) against
the loop-over-experts reference, under TRITON_INTERPRET=1 at small shapes (compiled on a GPU); its FP8 mode (e4m3
experts with block scales, activations quantized in the kernel) against the FP8 reference, and that reference
against plain math on the dequantized weights."""

from __future__ import annotations

import pytest
import torch

from kernels_testutil import HAS_CUDA, HAS_TRITON, requires_triton

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


# --- expert parallelism: w13 / w2 hold experts [start, start + E / ep), topk_ids stay global ---------------------

def _align_local_reference(ids, start, n_local, block_m):
    """moe_align's layout restricted to the experts [start, start + n_local), as plain loops: (the used rows, the
    used tiles' local experts); every row past them is padding (P) and every tile past them -1."""
    flat = ids.reshape(-1).tolist()
    P = len(flat)
    rows, tiles = [], []
    for e in range(n_local):
        mine = [p for p, g in enumerate(flat) if g == start + e]
        if mine:
            n = -(-len(mine) // block_m) * block_m
            rows += mine + [P] * (n - len(mine))
            tiles += [e] * (n // block_m)
    return rows, tiles


@pytest.mark.parametrize("one_launch", ALIGN_PATHS)
@pytest.mark.parametrize("T,E,k,ep,block_m", [(1, 8, 2, 2, 16), (17, 8, 3, 2, 16), (24, 64, 8, 4, 16),
                                              (9, 6, 6, 3, 32)])
def test_align_keeps_only_local_pairs(one_launch, T, E, k, ep, block_m):
    """Each rank's sort (expert_start = r E / ep, E / ep local experts) equals the reference restricted to its
    experts: its pairs only, each once, local expert ids; the rows its grouped GEMMs run (the used tiles) are its
    pairs padded per expert, and the ranks' pairs together are every pair exactly once. Skewed loads (some ranks'
    experts mostly empty); k = E (every rank gets every token)."""
    g = torch.Generator().manual_seed(T * E + ep)
    p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64)
    ids = torch.stack([torch.multinomial(p, k, replacement=False, generator=g) for _ in range(T)]).to(DEV)
    P, n = T * k, E // ep
    seen = []
    for r in range(ep):
        sorted_ids, tile_expert = moe_align(ids, n, block_m, one_launch=one_launch, expert_start=r * n)
        rows, tiles = _align_local_reference(ids.cpu(), r * n, n, block_m)
        assert sorted_ids.numel() == max_sorted_rows(P, n, block_m) == block_m * tile_expert.numel()
        assert sorted_ids[:len(rows)].tolist() == rows and (sorted_ids[len(rows):] == P).all()
        assert tile_expert[:len(tiles)].tolist() == tiles and (tile_expert[len(tiles):] == -1).all()
        mine = sorted_ids[sorted_ids < P].cpu()
        local = ((ids >= r * n) & (ids < (r + 1) * n)).reshape(-1).cpu()
        assert sorted(mine.tolist()) == local.nonzero().reshape(-1).tolist()
        assert block_m * int((tile_expert >= 0).sum()) == len(rows) < P + n * block_m
        seen += mine.tolist()
    assert sorted(seen) == list(range(P))


def _ep_slices(E, ep):
    return [(r * (E // ep), (r + 1) * (E // ep)) for r in range(ep)]


@requires_triton
@pytest.mark.parametrize("T,k,ep,dtype", [(1, 2, 2, torch.float32), (17, 3, 2, torch.bfloat16),
                                          (5, 2, 4, torch.float32), (40, 8, 2, torch.float32)])
def test_expert_parallel_partials(T, k, ep, dtype):
    """Each rank's op over its experts equals the reference over the same experts (and that, the whole op with the
    other ranks' pairs weighted 0); the ranks' partials sum to the whole op. 40 x 8 pairs take the torch sort."""
    E, H, I = 8, 32, 16  # noqa: E741
    g, w13, w2 = _weights(E, H, I, dtype, seed=T * 10 + ep)
    x = torch.randn(T, H, generator=g).to(dtype).to(DEV)
    tw, ids = _routing(T, E, k, "random", g)
    parts = []
    for a, b in _ep_slices(E, ep):
        want = fused_moe_ref(x, w13[a:b], w2[a:b], tw, ids, expert_start=a)
        masked = fused_moe_ref(x, w13, w2, tw.masked_fill((ids < a) | (ids >= b), 0.0), ids)
        torch.testing.assert_close(want, masked, rtol=0, atol=0)
        got = fused_moe_triton(x, w13[a:b], w2[a:b], tw, ids, expert_start=a, total_experts=E)
        torch.testing.assert_close(got, want, **TOL[dtype])
        parts.append(got.float())
    torch.testing.assert_close(sum(parts), fused_moe_ref(x, w13, w2, tw, ids).float(), **TOL[dtype])


def test_expert_parallel_launch_follows_the_local_share():
    """A prefill of 256 tokens x 8 over Qwen3-30B-A3B's 128 experts at ep 8 (16 held here): 16 pairs per expert
    on average, as without expert parallelism, so 16-row tiles; counting all 2048 pairs over the 16 local experts
    would pick 64-row tiles a quarter full."""
    from gyrfalcon.kernels.fused_moe.triton import tuning_pairs

    assert tuning_pairs(2048, 16, 128) == 256 and tuning_pairs(2048, 128) == tuning_pairs(2048, 128, 128) == 2048
    assert tuning_pairs(8, 16, 128) == 1  # a batch-1 decode step: never 0
    local = default_config(tuning_pairs(2048, 16, 128), 16, 2048, 768)
    assert local.block_m == default_config(2048, 128, 2048, 768).block_m == 16
    assert default_config(2048, 16, 2048, 768).block_m == 64


@pytest.mark.parametrize("triton_path", [pytest.param(True, marks=requires_triton, id="triton"),
                                         pytest.param(False, id="ref")])
def test_expert_parallel_never_computes_remote_pairs(triton_path):
    """A token whose every expert is another rank's, given NaN inputs, leaves exactly 0 in this rank's output (its
    rows are never computed: computing them as some local expert with weight 0 would give NaN), while the
    tokens with a local expert are unchanged."""
    E, H, I, T, k = 8, 32, 16, 6, 2  # noqa: E741
    g, w13, w2 = _weights(E, H, I, torch.float32, seed=4)
    x = torch.randn(T, H, generator=g).to(DEV)
    tw, ids = _routing(T, E, k, "random", g)
    ids[0] = torch.tensor([5, 6], device=DEV)  # both on rank 1 of 2
    ids[1] = torch.tensor([1, 7], device=DEV)  # one on each rank
    x_nan = x.clone()
    x_nan[0] = float("nan")
    op = fused_moe_triton if triton_path else fused_moe_ref
    got = op(x_nan, w13[:4], w2[:4], tw, ids, expert_start=0)
    assert torch.isfinite(got).all() and not got[0].any()
    want = fused_moe_ref(x, w13[:4], w2[:4], tw, ids, expert_start=0)
    torch.testing.assert_close(got[1:], want[1:], **TOL[torch.float32])


# --- FP8 experts: e4m3 weights with (bn, bk) block scales, activations quantized per token and bk columns -------

from gyrfalcon.kernels.fp8_gemm import quantize_weight_blockwise  # noqa: E402
from gyrfalcon.kernels.fused_moe.configs import fp8_config  # noqa: E402


def _fp8_experts(E, H, I, seed, block=(128, 128), whole=False):  # noqa: E741
    """(w13 e4m3 [E, 2I, H], s13 [E, ceil(2I / bn), ceil(H / bk)], w2 e4m3 [E, H, I], s2 [E, ceil(H / bn),
    ceil(I / bk)]) from random fp32 weights whose rows differ in size by up to 20x between experts and blocks (so
    a scale taken from the wrong block or expert moves the output by much more than the quantization error).
    whole=False: each expert's gate and up halves quantized apart and stacked (the checkpoint format, I % bn == 0);
    True: the stacked [2I, H] quantized as one matrix (`--quantization fp8`)."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=g) / I ** 0.5
    w13 *= torch.exp(0.7 * torch.randn(E, 2 * I, 1, generator=g))  # row sizes vary: block amaxes differ
    w2 *= torch.exp(0.7 * torch.randn(E, 1, I, generator=g))

    def quant(w):
        qs = [quantize_weight_blockwise(m, block) for m in w]
        return torch.stack([q for q, _ in qs]).to(DEV), torch.stack([s for _, s in qs]).to(DEV)

    if whole:
        q13, s13 = quant(w13)
    else:
        assert I % block[0] == 0
        qg, sg = quant(w13[:, :I])
        qu, su = quant(w13[:, I:])
        q13, s13 = torch.cat([qg, qu], 1), torch.cat([sg, su], 1)
    q2, s2 = quant(w2)
    return g, q13, s13, q2, s2


def _fp8_check(T, E, k, H, I, dtype, mode, block=(128, 128), whole=False, config=None, seed=None):  # noqa: E741
    g, q13, s13, q2, s2 = _fp8_experts(E, H, I, seed if seed is not None else T * 100 + E * 10 + k, block, whole)
    x = (torch.randn(T, H, generator=g) * torch.exp(0.5 * torch.randn(T, 1, generator=g))).to(dtype).to(DEV)
    tw, ids = _routing(T, E, k, mode, g)
    want = fused_moe_ref(x, q13, q2, tw, ids, s13, s2, block)
    got = fused_moe_triton(x, q13, q2, tw, ids, s13, s2, block, config=config)
    assert got.shape == (T, H) and got.dtype == dtype
    _fp8_close(got, want, dtype)
    return got, want


def _fp8_close(got, want, dtype):
    """Kernel vs reference on the same quantized operands, rows compared relative to their own max (a wrong scale
    block or expert moves a row by O(its size): the test weights' block amaxes differ by up to several times).
    Interpreter: the same fp32 operations in another summation order; fp32 1e-4, bf16 1e-2 (the gate / up outputs
    rounded to bf16 may land one ulp, 2^-8, apart). GPU: the kernel's fp32 division x / scale is not IEEE-exact,
    so a value on an e4m3 rounding boundary may round the other way (that term off by 2^-4 of itself), in either
    GEMM; 2e-2 of the row's max covers a few such flips."""
    from gyrfalcon.kernels.common import interpreting

    rel = (1e-4 if dtype == torch.float32 else 1e-2) if interpreting() else 2e-2
    row = want.float().abs().amax(dim=1, keepdim=True)
    err = (got.float() - want.float()).abs()
    assert (err <= rel * row + rel * want.float().abs()).all(), (err / row.clamp_min(1e-30)).max()


@requires_triton
@pytest.mark.parametrize("T,k,dtype", [(1, 1, torch.bfloat16), (1, 8, torch.float32), (3, 2, torch.float32),
                                       (17, 8, torch.bfloat16)])
def test_fp8_matches_reference(T, k, dtype):
    """Checkpoint-format experts (gate / up scales stacked) at 128 x 128 blocks, H 200 (a partial K block for
    gate_up, a partial scale row-block of w2), I 128, over 8 experts: top-k 1 / 2 / 8, decode and larger T."""
    _fp8_check(T, 8, k, 200, 128, dtype, "random")


@requires_triton
@pytest.mark.parametrize("mode,T,k", [("skewed", 17, 1), ("low_only", 3, 2), ("all_one", 17, 1),
                                      ("all_one", 3, 2)])
def test_fp8_uneven_and_empty_experts(mode, T, k):
    """Uneven loads and empty experts (low_only: experts past k + 1 get no pair)."""
    _fp8_check(T, 8, k, 136, 128, torch.bfloat16, mode)


@requires_triton
@pytest.mark.parametrize("H,I,dtype", [(136, 192, torch.float32), (64, 80, torch.bfloat16)])
def test_fp8_whole_stacked_odd_intermediate(H, I, dtype):  # noqa: E741
    """`--quantization fp8`'s layout: w13 quantized as one [2I, H] matrix, so the up rows I .. 2I - 1 straddle
    two 128-row scale blocks (rows 192..383 / 80..159 across rows 256 / 128). I 192: 64-column tiles divide I, so
    each program's up columns still lie in one block (the scalar-scale path); I 80: a tile of up columns 112..175
    straddles the boundary (the per-column scale path, SCALE_COLS). I is a partial K block of the down GEMM too,
    and H 64 is less than one block."""
    cfg = fp8_config(5 * 2, 6, H, I)
    assert cfg.up.block_n == 64 and (I % 64 == 0) == (I == 192)
    _fp8_check(5, 6, 2, H, I, dtype, "random", whole=True)


@requires_triton
def test_fp8_several_tiles_and_k_steps():
    """33 tokens all on expert 5 (three 16-row tiles, the last mostly padding), K in three 128-wide steps for
    gate_up (H 320, the last partial) and two for down (I 256), 32-column tiles: many programs each walking
    several scale blocks."""
    cfg = MoeConfig(16, GemmTile(32, 128, 4, 1), GemmTile(32, 128, 4, 1))
    g, q13, s13, q2, s2 = _fp8_experts(6, 320, 256, seed=7)
    x = torch.randn(33, 320, generator=g).to(DEV)
    ids = torch.full((33, 1), 5, dtype=torch.int64, device=DEV)
    tw = torch.rand(33, 1, generator=g).float().to(DEV)
    want = fused_moe_ref(x, q13, q2, tw, ids, s13, s2)
    _fp8_close(fused_moe_triton(x, q13, q2, tw, ids, s13, s2, config=cfg), want, torch.float32)


@requires_triton
def test_fp8_small_blocks():
    """A (32, 64) weight block (bn != bk), so tiles, scale rows and K steps all differ from the 128 defaults."""
    _fp8_check(9, 8, 3, 160, 64, torch.float32, "skewed", block=(32, 64))


@requires_triton
def test_fp8_unselected_experts_scales_never_read():
    """NaN scales in every expert no pair selected leave the output finite and equal to the reference's."""
    g, q13, s13, q2, s2 = _fp8_experts(8, 136, 128, seed=11)
    x = torch.randn(3, 136, generator=g).to(DEV)
    tw, ids = _routing(3, 8, 2, "low_only", g)
    unused = torch.ones(8, dtype=torch.bool)
    unused[ids.reshape(-1).cpu()] = False
    assert unused.any()
    s13p, s2p = s13.clone(), s2.clone()
    s13p[unused.to(DEV)] = float("nan")
    s2p[unused.to(DEV)] = float("nan")
    got = fused_moe_triton(x, q13, q2, tw, ids, s13p, s2p)
    assert torch.isfinite(got).all()
    _fp8_close(got, fused_moe_ref(x, q13, q2, tw, ids, s13, s2), torch.float32)


def _dequant_independent(q, s, block):
    """q e4m3 [E, N, K], s [E, ceil(N / bn), ceil(K / bk)] -> fp32 [E, N, K], written here without kernels/fp8_gemm:
    each element times the scale of block (n // bn, k // bk)."""
    E, N, K = q.shape
    bn, bk = block
    rows = torch.arange(N) // bn
    cols = torch.arange(K) // bk
    return q.float() * s[:, rows][:, :, cols]


# The FP8 reference against plain bf16 math on the dequantized weights with unquantized activations (the
# weight-only path: transformers on a dequantized checkpoint): they differ by the activation quantization alone.
# e4m3 rounds a value in [2^e, 2^(e+1)) to a multiple of 2^(e-3): a uniform error of RMS 2^(e-3) / sqrt(12), ~2.4%
# of a typical value. A GEMM output sum_i x_i (1 + eps_i) w_i is then off by sum_i eps_i x_i w_i, ~2.4% of it
# (independent errors, random signs); silu(g) * u carries gate's and up's (~3.4%), and the down GEMM's input is
# quantized again (another 2.4%): ~4.2% relative RMS at the output. Measured 3.2-5.3% over 8 seeds of this
# problem. Bound: 8%. A scale-routing mistake is far past it (measured: gate / up scale blocks swapped 13-57%,
# each expert given its neighbour's scales 46-166%).
FP8_ACT_RMS = 0.08


def test_fp8_reference_against_dequantized_bf16_math():
    E, H, I, T, k = 8, 256, 128, 24, 2  # noqa: E741
    g, q13, s13, q2, s2 = _fp8_experts(E, H, I, seed=5)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(DEV)
    tw, ids = _routing(T, E, k, "random", g)
    w13d = _dequant_independent(q13.cpu(), s13.cpu(), (128, 128)).to(torch.bfloat16).to(DEV)
    w2d = _dequant_independent(q2.cpu(), s2.cpu(), (128, 128)).to(torch.bfloat16).to(DEV)
    want = fused_moe_ref(x, w13d, w2d, tw, ids).float()

    def rel_rms(s13_, s2_):
        got = fused_moe_ref(x, q13, q2, tw, ids, s13_, s2_).float()
        return ((got - want).norm() / want.norm()).item()

    assert rel_rms(s13, s2) <= FP8_ACT_RMS
    # the bound has teeth: the gate / up scale row-blocks swapped, or each expert given the next one's scales
    assert rel_rms(s13.flip(1), s2) > 1.5 * FP8_ACT_RMS
    assert rel_rms(s13.roll(1, 0), s2.roll(1, 0)) > 1.5 * FP8_ACT_RMS


def test_fp8_dispatcher_routes_cpu_to_reference(monkeypatch):
    import gyrfalcon.kernels.fused_moe as pkg
    called = []
    monkeypatch.setattr(pkg, "fused_moe_triton", lambda *a, **kw: called.append(1))
    g, q13, s13, q2, s2 = _fp8_experts(4, 136, 128, seed=2)
    q13, s13, q2, s2 = q13.cpu(), s13.cpu(), q2.cpu(), s2.cpu()
    x = torch.randn(3, 136, generator=g)
    tw, ids = _routing(3, 4, 2, "random", g)
    tw, ids = tw.cpu(), ids.cpu()
    out = pkg.fused_moe(x, q13, q2, tw, ids, s13, s2)
    assert not called
    torch.testing.assert_close(out, fused_moe_ref(x, q13, q2, tw, ids, s13, s2), rtol=0, atol=0)
    # and the scales matter: the unquantized op on the raw e4m3 values is something else
    assert not torch.allclose(out, fused_moe_ref(x, q13.float(), q2.float(), tw, ids), rtol=0.1, atol=0.1)


def test_fp8_argument_errors():
    g, q13, s13, q2, s2 = _fp8_experts(4, 136, 128, seed=3)
    x = torch.randn(2, 136, generator=g).to(DEV)
    tw, ids = _routing(2, 4, 2, "random", g)
    with pytest.raises(ValueError, match="both"):
        fused_moe_ref(x, q13, q2, tw, ids, s13, None)
    with pytest.raises(ValueError, match="w2_scale must be"):
        fused_moe_ref(x, q13, q2, tw, ids, s13, s2[:, :1])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fused_moe_ref(x, q13.float(), q2, tw, ids, s13, s2)
    if HAS_TRITON:
        bad = MoeConfig(16, GemmTile(32, 64, 4, 1), GemmTile(32, 64, 4, 1))
        with pytest.raises(ValueError, match="width 128"):
            fused_moe_triton(x, q13, q2, tw, ids, s13, s2, config=bad)


def test_fp8_config_follows_the_weight_block():
    """BLOCK_K = bk; BLOCK_N <= bn and dividing it, at decode and prefill sizes and for a 96-row block."""
    for P, E, H, I in ((8, 128, 2048, 768), (16 * 8, 128, 2048, 768), (256 * 8, 8, 3072, 1536), (17, 8, 200, 128)):  # noqa: E741
        for block in ((128, 128), (96, 64)):
            cfg = fp8_config(P, E, H, I, block)
            for t in (cfg.up, cfg.down):
                assert t.block_k == block[1] and block[0] % t.block_n == 0 and 16 <= t.block_n <= block[0]
    assert fp8_config(8, 128, 2048, 768).block_m == default_config(8, 128, 2048, 768).block_m == 16


@requires_triton
def test_fp8_expert_parallel_partials():
    """FP8 experts split over two ranks (their scales with them): each rank's op equals the FP8 reference over its
    experts, and the partials sum to the whole FP8 reference."""
    E, H, I, T, k = 8, 136, 128, 9, 3  # noqa: E741
    g, q13, s13, q2, s2 = _fp8_experts(E, H, I, seed=21)
    x = torch.randn(T, H, generator=g).to(DEV)
    tw, ids = _routing(T, E, k, "random", g)
    parts = []
    for a, b in _ep_slices(E, 2):
        want = fused_moe_ref(x, q13[a:b], q2[a:b], tw, ids, s13[a:b], s2[a:b], expert_start=a)
        got = fused_moe_triton(x, q13[a:b], q2[a:b], tw, ids, s13[a:b], s2[a:b], expert_start=a)
        _fp8_close(got, want, torch.float32)
        parts.append(want)
    torch.testing.assert_close(sum(parts), fused_moe_ref(x, q13, q2, tw, ids, s13, s2), rtol=1e-5, atol=1e-5)
