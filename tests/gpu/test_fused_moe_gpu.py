"""The fused-MoE Triton op against its reference on a GPU, bf16, at real MoE shapes (Qwen3-30B-A3B: E 128, k 8,
H 2048, I 768; MiniMax-M2: E 256, k 8, H 3072, I 1536) for decode (T = 1, 16) and prefill-sized (T = 256) batches,
plus CUDA-graph capture and replay with new inputs; the same for FP8 experts (e4m3 with 128 x 128 block scales, as
Qwen3-30B-A3B-FP8 and MiniMax-M2 ship them) against the FP8 reference. Run through scripts/gpu/test.sh or
`pytest tests/gpu/test_fused_moe_gpu.py`."""

import pytest
import torch

# Skip before importing the kernels: on a CPU-only run, importing triton here (before tests/kernels'
# conftest turns the interpreter on) would leave the interpreted CPU kernel tests unable to run.
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from gyrfalcon.kernels.fp8_gemm import quantize_weight_blockwise  # noqa: E402
from gyrfalcon.kernels.fused_moe import fused_moe, fused_moe_ref, fused_moe_triton  # noqa: E402

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")
BF16 = torch.bfloat16
# Both sides round the two GEMMs' outputs to bf16; their fp32 accumulation orders differ, so an intermediate may
# land one bf16 ulp apart and carry that through the down GEMM.
TOL = dict(atol=3e-2, rtol=3e-2)
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "minimax-m2": (256, 8, 3072, 1536)}
_WEIGHTS: dict = {}


def _weights(name):
    """w13 [E, 2I, H], w2 [E, H, I] bf16, scaled so gate / up / the output are O(1) (cached per shape: 7 GB at
    MiniMax-M2's)."""
    if name not in _WEIGHTS:
        _WEIGHTS.clear()
        E, _, H, I = SHAPES[name]  # noqa: E741
        g = torch.Generator(device=DEV).manual_seed(0)
        w13 = torch.randn(E, 2 * I, H, device=DEV, dtype=BF16, generator=g) * H ** -0.5
        w2 = torch.randn(E, H, I, device=DEV, dtype=BF16, generator=g) * I ** -0.5
        _WEIGHTS[name] = (w13, w2)
    return _WEIGHTS[name]


def _routing(T, E, k, seed, skew=False):
    """topk_ids [T, k] int64 (distinct per row: a top-k of random router logits), topk_weights [T, k] fp32
    (softmax over the chosen logits). skew: a bias toward low expert ids (uneven loads, many experts empty)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    logits = torch.randn(T, E, device=DEV, generator=g)
    if skew:
        logits = logits - torch.arange(E, device=DEV) * 0.2
    vals, ids = torch.topk(logits, k, dim=-1)
    return torch.softmax(vals, dim=-1).float(), ids


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("T", [1, 16, 256])
@pytest.mark.parametrize("skew", [False, True], ids=["uniform", "skewed"])
def test_matches_reference(name, T, skew):
    E, k, H, _ = SHAPES[name]
    w13, w2 = _weights(name)
    x = torch.randn(T, H, device=DEV, dtype=BF16)
    tw, ids = _routing(T, E, k, seed=T, skew=skew)
    want = fused_moe_ref(x, w13, w2, tw, ids)
    got = fused_moe_triton(x, w13, w2, tw, ids)
    torch.testing.assert_close(got, want, **TOL)
    assert torch.equal(fused_moe(x, w13, w2, tw, ids), got)  # the dispatcher's CUDA path, deterministic


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("T", [1, 16])
def test_cuda_graph_capture_and_replay(name, T):
    """The op captures (no host sync: the sort runs on the device, the grids come from shapes) and replays with
    new tokens and new routing written into the captured inputs."""
    E, k, H, _ = SHAPES[name]
    w13, w2 = _weights(name)
    x = torch.randn(T, H, device=DEV, dtype=BF16)
    tw, ids = _routing(T, E, k, seed=1)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up off the capture (compiles the kernels)
        fused_moe_triton(x, w13, w2, tw, ids)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_triton(x, w13, w2, tw, ids)
    for seed in (2, 3):
        x.copy_(torch.randn(T, H, device=DEV, dtype=BF16))
        new_tw, new_ids = _routing(T, E, k, seed=seed, skew=seed == 3)
        tw.copy_(new_tw)
        ids.copy_(new_ids)
        graph.replay()
        torch.testing.assert_close(out, fused_moe_ref(x, w13, w2, tw, ids), **TOL)


# --- FP8 experts ---------------------------------------------------------------------------------------------

_FP8: dict = {}


def _fp8_weights(name):
    """(w13 e4m3 [E, 2I, H], w13_scale [E, 2I / 128, H / 128], w2 e4m3 [E, H, I], w2_scale [E, H / 128, I / 128])
    from _weights(name): each expert's gate and up halves quantized apart and stacked, as a checkpoint's are
    (I = 768 / 1536: whole 128-row blocks)."""
    if name not in _FP8:
        _FP8.clear()
        w13, w2 = _weights(name)
        inter = w2.shape[2]

        def quant(ws):
            qs = [quantize_weight_blockwise(w) for w in ws]
            return torch.stack([q for q, _ in qs]), torch.stack([sc for _, sc in qs])

        qg, sg = quant(w13[:, :inter])
        qu, su = quant(w13[:, inter:])
        q2, s2 = quant(w2)
        _FP8[name] = (torch.cat([qg, qu], 1), torch.cat([sg, su], 1), q2, s2)
    return _FP8[name]


def _fp8_close(got, want):
    """Kernel vs FP8 reference, same quantized operands. Besides the bf16 path's causes (fp32 summation order, a
    bf16 intermediate one ulp apart), the kernel's fp32 division x / scale is not IEEE-exact, so an activation on an
    e4m3 rounding boundary may round the other way (that one term off by 2^-4 of itself); at H 2048-3072 such a
    term is a small part of its row. Rows compared relative to their own max: 3e-2 (as the bf16 TOL), plus 3e-2 of
    each element. A wrong scale block or expert moves a row by O(its size)."""
    row = want.float().abs().amax(dim=1, keepdim=True)
    err = (got.float() - want.float()).abs()
    assert (err <= 3e-2 * row + 3e-2 * want.float().abs()).all(), (err / row.clamp_min(1e-30)).max()


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("T", [1, 16, 256])
@pytest.mark.parametrize("skew", [False, True], ids=["uniform", "skewed"])
def test_fp8_matches_reference(name, T, skew):
    E, k, H, _ = SHAPES[name]
    w13, s13, w2, s2 = _fp8_weights(name)
    x = torch.randn(T, H, device=DEV, dtype=BF16)
    tw, ids = _routing(T, E, k, seed=T, skew=skew)
    want = fused_moe_ref(x, w13, w2, tw, ids, s13, s2)
    got = fused_moe_triton(x, w13, w2, tw, ids, s13, s2)
    assert got.dtype == BF16 and torch.isfinite(got).all()
    _fp8_close(got, want)
    assert torch.equal(fused_moe(x, w13, w2, tw, ids, s13, s2), got)  # the dispatcher's CUDA path, deterministic


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("T", [1, 16])
def test_fp8_cuda_graph_capture_and_replay(name, T):
    """The FP8 op captures (activation scales computed inside the GEMM kernels, no host sync) and replays with new
    tokens and routing written into the captured inputs."""
    E, k, H, _ = SHAPES[name]
    w13, s13, w2, s2 = _fp8_weights(name)
    x = torch.randn(T, H, device=DEV, dtype=BF16)
    tw, ids = _routing(T, E, k, seed=1)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up off the capture (compiles the kernels)
        fused_moe_triton(x, w13, w2, tw, ids, s13, s2)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_triton(x, w13, w2, tw, ids, s13, s2)
    for seed in (2, 3):
        x.copy_(torch.randn(T, H, device=DEV, dtype=BF16))
        new_tw, new_ids = _routing(T, E, k, seed=seed, skew=seed == 3)
        tw.copy_(new_tw)
        ids.copy_(new_ids)
        graph.replay()
        _fp8_close(out, fused_moe_ref(x, w13, w2, tw, ids, s13, s2))
