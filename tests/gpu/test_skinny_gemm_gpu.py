"""The stream-K skinny GEMM at real shapes in bf16 on the GPU: against cuBLAS, plain and adding into the
residual stream, launched eagerly and replayed in a CUDA graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from gyrfalcon.kernels.skinny_gemm import skinny_gemm_triton  # noqa: E402

SHAPES = {  # (K, N): Llama-3.1-8B's qkv, o, gate_up, down; Qwen3-0.6B's qkv and down; the Llama LM head
    "l8_qkv": (4096, 6144), "l8_o": (4096, 4096), "l8_gate_up": (4096, 28672), "l8_down": (14336, 4096),
    "q06_qkv": (1024, 4096), "q06_down": (3072, 1024), "l8_lm_head": (4096, 128256),
}


def _data(M, K, N, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).bfloat16()
    r = torch.randn(M, N, device="cuda", generator=g).bfloat16()
    return x, w, r


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("M", [2, 16, 33, 64, 128])
@pytest.mark.parametrize("add", [False, True], ids=["plain", "add"])
def test_matches_cublas(name, M, add):
    K, N = SHAPES[name]
    x, w, r = _data(M, K, N)
    if add:
        ref = (r.float() + x.float() @ w.float().t()).bfloat16()
        out = r.clone()
        y = skinny_gemm_triton(x, w, add_to=out)
        assert y.data_ptr() == out.data_ptr()
    else:
        ref = F.linear(x, w)
        y = skinny_gemm_triton(x, w)
    torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_graph_replays_match_eager():
    """Captured once, replayed over new inputs: each replay equals an eager launch on them bit for bit (the
    arrival counters are back at zero after every launch, and the summation order is fixed by the shape)."""
    K, N, M = 4096, 6144, 64
    x, w, _ = _data(M, K, N, seed=1)
    skinny_gemm_triton(x, w)  # the counters and the kernel exist before capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = skinny_gemm_triton(x, w)
    for seed in range(3):
        x.copy_(_data(M, K, N, seed=10 + seed)[0])
        g.replay()
        torch.testing.assert_close(y, skinny_gemm_triton(x, w), rtol=0, atol=0)
