import pytest
import torch

from gyrfalcon.kernels.rms_norm import rms_norm_ref, rms_norm_triton
from kernels_testutil import DEVICE, DTYPES, TOL, requires_triton


def _formula(x, w, eps, offset=0.0):
    xd = x.double()
    y = xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + eps)
    return y * (w.double() + offset) if w is not None else y


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_ref_matches_formula(offset):
    x = torch.randn(6, 40)
    w = torch.randn(40)
    torch.testing.assert_close(rms_norm_ref(x, w, 1e-5, weight_offset=offset).double(),
                               _formula(x, w, 1e-5, offset), atol=1e-5, rtol=1e-5)


def test_ref_residual_adds_in_model_dtype():
    x = torch.randn(4, 32).bfloat16()
    r = torch.randn(4, 32).bfloat16()
    w = torch.randn(32).bfloat16()
    out, new_res = rms_norm_ref(x, w, 1e-6, residual=r)
    s = x + r  # bf16 add, as the model does it
    assert new_res.dtype == torch.bfloat16 and torch.equal(new_res, s)
    torch.testing.assert_close(out.float(), _formula(s.float(), w, 1e-6).float(), **TOL[torch.bfloat16])


def test_ref_per_head_and_no_weight():
    x = torch.randn(3, 4, 16)
    torch.testing.assert_close(rms_norm_ref(x, None, 1e-6).double(), _formula(x, None, 1e-6))


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 64), (3, 100), (2, 3, 48), (40, 32)])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_triton_matches_ref(dtype, shape, residual, offset):
    x = torch.randn(shape, device=DEVICE).to(dtype)
    w = (torch.randn(shape[-1], device=DEVICE) * 0.5).to(dtype)
    r = torch.randn(shape, device=DEVICE).to(dtype) if residual else None
    got = rms_norm_triton(x, w, 1e-6, r, weight_offset=offset)
    want = rms_norm_ref(x, w, 1e-6, r, weight_offset=offset)
    if residual:
        assert got[0].shape == want[0].shape and got[1].shape == want[1].shape
        torch.testing.assert_close(got[1], want[1], **TOL[dtype])
        torch.testing.assert_close(got[0], want[0], **TOL[dtype])
    else:
        assert got.shape == want.shape and got.dtype == dtype
        torch.testing.assert_close(got, want, **TOL[dtype])


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_strided_per_head_qk_norm(dtype):
    # q and k sliced out of a fused qkv projection: [T, H, D] views with a large token stride.
    T, H, Hkv, D = 5, 4, 2, 32
    qkv = torch.randn(T, (H + 2 * Hkv) * D, device=DEVICE).to(dtype)
    q = qkv[:, : H * D].view(T, H, D)
    k = qkv[:, H * D : (H + Hkv) * D].view(T, Hkv, D)
    w = torch.randn(D, device=DEVICE).to(dtype)
    for t in (q, k):
        assert not t.is_contiguous()
        torch.testing.assert_close(rms_norm_triton(t, w, 1e-6), rms_norm_ref(t, w, 1e-6), **TOL[dtype])


@requires_triton
def test_triton_no_weight_and_empty():
    x = torch.randn(3, 24, device=DEVICE)
    torch.testing.assert_close(rms_norm_triton(x, None, 1e-6), rms_norm_ref(x, None, 1e-6), **TOL[torch.float32])
    e = torch.randn(0, 24, device=DEVICE)
    assert rms_norm_triton(e, torch.ones(24, device=DEVICE), 1e-6).shape == (0, 24)


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("widths", [(64, 32, 32), (6144, 1024, 1024), (40, 24, 8)])
def test_qk_norm_whole_matches_reference(dtype, widths):
    """MiniMax-M2's whole-projection q / k norms in one launch: q and k columns normalized each as one row, v
    copied bit for bit; a strided (sliced) input row too."""
    from gyrfalcon.kernels.rms_norm import qk_norm_whole_ref, qk_norm_whole_triton

    qw, kw, vw = widths
    g = torch.Generator().manual_seed(qw)
    big = torch.randn(5, qw + kw + vw + 8, generator=g).to(dtype).to(DEVICE)
    qkv = big[:, 8:]  # row stride wider than the row
    q_w = (1 + 0.1 * torch.randn(qw, generator=g)).to(dtype).to(DEVICE)
    k_w = (1 + 0.1 * torch.randn(kw, generator=g)).to(dtype).to(DEVICE)
    got = qk_norm_whole_triton(qkv, q_w, k_w, 1e-6)
    want = qk_norm_whole_ref(qkv, q_w, k_w, 1e-6)
    assert got.shape == qkv.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert torch.equal(got[:, qw + kw:], qkv[:, qw + kw:])
    # the reference is the two norms of the package's rms_norm
    torch.testing.assert_close(want[:, :qw].double(), _formula(qkv[:, :qw].float(), q_w, 1e-6).to(want.dtype).double(),
                               **TOL[dtype])
