"""The fused small-batch norm+GEMV kernel at real shapes in bf16 on the GPU."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from gyrfalcon.kernels.small_m_gemv import norm_gemv_ref, norm_gemv_triton  # noqa: E402

SHAPES = {  # (K, N, silu): Llama-3.1-8B's qkv, o, gate_up, down; Qwen3-0.6B's qkv
    "l8_qkv": (4096, 6144, False), "l8_o": (4096, 4096, False), "l8_gate_up": (4096, 14336, True),
    "l8_down": (14336, 4096, False), "q06_qkv": (1024, 4096, False),
}


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("M", [1, 8, 16])
def test_matches_reference(name, M):
    K, N, silu = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    r = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    w = (torch.randn(2 * N if silu else N, K, device="cuda", generator=g) / K ** 0.5).bfloat16()
    nw = (1 + 0.1 * torch.randn(K, device="cuda", generator=g)).bfloat16()
    norm = name.endswith(("qkv", "gate_up"))
    kw = dict(norm_weight=nw if norm else None, residual=r if norm else None, silu_mul=silu)
    y_ref, r_ref = norm_gemv_ref(x, w, **kw)
    y, r_new = norm_gemv_triton(x, w, **kw)
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=2e-2, atol=2e-2)
    if norm:
        torch.testing.assert_close(r_new, r_ref, rtol=0, atol=0)
