"""The batch-1 MLP in one launch (kernels/fused_mlp.py) at real shapes in bf16 on the GPU: alone, and chained in
a CUDA graph with programmatic dependent launch, as a decode graph runs it layer after layer."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from gyrfalcon.kernels._common import pdl_possible  # noqa: E402
from gyrfalcon.kernels.fused_mlp import _workspace, fused_mlp_ref, fused_mlp_triton  # noqa: E402

SHAPES = {"qwen3-0.6b": (1024, 3072), "qwen3-1.7b": (2048, 6144), "llama-3.1-8b": (4096, 14336)}  # (H, I)


def _layer(H, I, g):
    nw = (1 + 0.1 * torch.randn(H, device="cuda", generator=g)).bfloat16()
    wgu = (torch.randn(2 * I, H, device="cuda", generator=g) / H ** 0.5).bfloat16()
    wd = (torch.randn(H, I, device="cuda", generator=g) / I ** 0.5).bfloat16()
    return nw, wgu, wd


@pytest.mark.parametrize("name", list(SHAPES))
def test_matches_reference(name):
    H, I = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, H, device="cuda", generator=g).bfloat16()
    r = torch.randn(1, H, device="cuda", generator=g).bfloat16()
    nw, wgu, wd = _layer(H, I, g)
    y_ref, r_ref = fused_mlp_ref(x, r, nw, wgu, wd, 1e-6)
    y, r_new = fused_mlp_triton(x, r, nw, wgu, wd, 1e-6, pdl=False)
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(r_new, r_ref, rtol=0, atol=0)
    acc, cnt = _workspace(x.device)
    torch.cuda.synchronize()
    assert int(cnt.item()) == 0 and float(acc.abs().max()) == 0.0


@pytest.mark.parametrize("pdl", [False, True])
def test_chained_layers_in_a_graph(pdl):
    """Four layers chained (each one's output and residual feed the next) captured in one CUDA graph, replayed
    twice on new inputs: each replay matches the references' chain, and the workspace ends at zero."""
    if pdl and not pdl_possible(torch.empty(1, device="cuda")):
        pytest.skip("PDL needs compute capability 9.0 and a Triton with grid-dependency control")
    H, I = SHAPES["qwen3-0.6b"]
    g = torch.Generator(device="cuda").manual_seed(1)
    layers = [_layer(H, I, g) for _ in range(4)]
    x_in = torch.empty(1, H, device="cuda", dtype=torch.bfloat16)
    r_in = torch.empty_like(x_in)

    def chain(fn, **kw):
        x, r = x_in, r_in
        for nw, wgu, wd in layers:
            x, r = fn(x, r, nw, wgu, wd, 1e-6, **kw)
        return x, r

    x_in.copy_(torch.randn(1, H, device="cuda", generator=g))
    r_in.copy_(torch.randn(1, H, device="cuda", generator=g))
    chain(fused_mlp_triton, pdl=pdl)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(fused_mlp_triton, pdl=pdl)
    for _ in range(2):
        x_in.copy_(torch.randn(1, H, device="cuda", generator=g))
        r_in.copy_(torch.randn(1, H, device="cuda", generator=g))
        graph.replay()
        ref = chain(fused_mlp_ref)
        torch.cuda.synchronize()
        torch.testing.assert_close(out[0].float(), ref[0].float(), rtol=3e-2, atol=3e-2)
        torch.testing.assert_close(out[1].float(), ref[1].float(), rtol=2e-2, atol=2e-2)
    acc, cnt = _workspace(x_in.device)
    assert int(cnt.item()) == 0 and float(acc.abs().max()) == 0.0
