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


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,d,hidden", [(3, 100, 64), (16, 1500, 300), (700, 40, 1100)],
                         ids=["few-rows", "blocks-per-program", "one-program-per-row"])
def test_row_scale_matches_ref(dtype, rows, d, hidden):
    """Folded post-attention norm: gate and up scaled by each row's rstd(r) before the SiLU-and-mul; few rows
    spread a row's column blocks over programs, many rows (a prefill) take one program per row that loops."""
    from gyrfalcon.kernels.rms_norm import row_rstd_ref

    g = torch.Generator().manual_seed(rows + d)
    x = (torch.randn(rows, 2 * d, generator=g) * 3).to(dtype).to(DEVICE)
    r = (torch.randn(rows, hidden, generator=g) * 5).to(dtype).to(DEVICE)
    got = silu_and_mul_triton(x, (r, 1e-5))
    want = silu_and_mul_ref(x, (r, 1e-5))
    torch.testing.assert_close(got, want, **TOL[dtype])
    # the reference itself: silu(s g) * (s u) with s = rstd(r), in fp32
    s = row_rstd_ref(r, 1e-5)[:, None]
    xf = x.float()
    direct = (torch.nn.functional.silu(xf[:, :d] * s) * (xf[:, d:] * s)).to(dtype)
    torch.testing.assert_close(want, direct, **TOL[dtype])
