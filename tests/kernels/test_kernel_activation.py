import pytest
import torch

from gyrfalcon.kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from kernels_testutil import DEVICE, DTYPES, TOL, requires_triton


def test_ref_matches_formula():
    x = torch.randn(5, 2 * 24, dtype=torch.float64)
    g, u = x[:, :24], x[:, 24:]
    want = g / (1 + torch.exp(-g)) * u
    torch.testing.assert_close(silu_and_mul_ref(x.float()).double(), want, atol=1e-6, rtol=1e-6)


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 2 * 64), (3, 2 * 100), (2, 3, 2 * 40), (1, 2 * 1500)])
def test_triton_matches_ref(dtype, shape):
    x = (torch.randn(shape, device=DEVICE) * 3).to(dtype)
    got = silu_and_mul_triton(x)
    assert got.shape == (*shape[:-1], shape[-1] // 2) and got.dtype == dtype
    torch.testing.assert_close(got, silu_and_mul_ref(x), **TOL[dtype])
