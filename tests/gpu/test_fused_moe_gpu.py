"""The fused-MoE Triton op against its reference on a GPU, bf16, at real MoE shapes (Qwen3-30B-A3B: E 128, k 8,
H 2048, I 768; MiniMax-M2: E 256, k 8, H 3072, I 1536) for decode (T = 1, 16) and prefill-sized (T = 256) batches,
plus CUDA-graph capture and replay with new inputs. Run through scripts/gpu/test.sh or
`pytest tests/gpu/test_fused_moe_gpu.py`."""

import pytest
import torch

# Skip before importing the kernels: on a CPU-only run, importing triton here (before tests/kernels'
# conftest turns the interpreter on) would leave the interpreted CPU kernel tests unable to run.
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

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
