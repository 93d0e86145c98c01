import pytest
import torch

from gyrfalcon.kernels.rotary import apply_rotary_ref, apply_rotary_triton
from kernels_testutil import DEVICE, DTYPES, TOL, requires_triton


def _cache(max_pos, rotary_dim, base=10000.0, device=DEVICE):
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat((ang.cos(), ang.sin()), dim=-1).float().to(device), ang


def _naive(x, positions, ang, rotary_dim, is_neox):
    """Rotation as complex multiplication by exp(i * angle), in float64."""
    xd = x.double()
    half = rotary_dim // 2
    rot = torch.polar(torch.ones_like(ang[positions]), ang[positions])[:, None, :]  # [T, 1, half]
    if is_neox:
        z = torch.complex(xd[..., :half], xd[..., half:rotary_dim]) * rot
        out_r = torch.cat((z.real, z.imag), dim=-1)
    else:
        z = torch.complex(xd[..., 0:rotary_dim:2], xd[..., 1:rotary_dim:2]) * rot
        out_r = torch.stack((z.real, z.imag), dim=-1).flatten(-2)
    return torch.cat((out_r, xd[..., rotary_dim:]), dim=-1)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [32, 16])
def test_ref_matches_complex_rotation(is_neox, rotary_dim):
    cs, ang = _cache(64, rotary_dim, device="cpu")
    q = torch.randn(5, 4, 32)
    k = torch.randn(5, 2, 32)
    pos = torch.tensor([0, 3, 63, 17, 17])
    q_out, k_out = apply_rotary_ref(q, k, pos, cs, rotary_dim, is_neox)
    torch.testing.assert_close(q_out.double(), _naive(q, pos, ang, rotary_dim, is_neox), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out.double(), _naive(k, pos, ang, rotary_dim, is_neox), atol=1e-5, rtol=1e-5)
    # Position 0 is the identity rotation.
    torch.testing.assert_close(q_out[0], q[0])


def test_ref_preserves_norm_and_k_none():
    cs, _ = _cache(16, 16, device="cpu")
    q = torch.randn(3, 2, 16)
    q_out, k_out = apply_rotary_ref(q, None, torch.tensor([1, 5, 9]), cs, 16)
    assert k_out is None
    torch.testing.assert_close(q_out.norm(dim=-1), q.norm(dim=-1))


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_dim,rotary_dim,H,Hkv", [(16, 16, 4, 2), (64, 32, 2, 1), (128, 128, 4, 4), (256, 64, 2, 1)])
def test_triton_matches_ref(dtype, is_neox, head_dim, rotary_dim, H, Hkv):
    T = 5
    cs, _ = _cache(40, rotary_dim)
    q = torch.randn(T, H, head_dim, device=DEVICE).to(dtype)
    k = torch.randn(T, Hkv, head_dim, device=DEVICE).to(dtype)
    pos = torch.tensor([0, 39, 7, 7, 20], device=DEVICE)
    want_q, want_k = apply_rotary_ref(q, k, pos, cs, rotary_dim, is_neox)
    q2, k2 = q.clone(), k.clone()
    got_q, got_k = apply_rotary_triton(q2, k2, pos, cs, rotary_dim, is_neox)
    assert got_q.data_ptr() == q2.data_ptr() and got_k.data_ptr() == k2.data_ptr()  # in place
    torch.testing.assert_close(got_q, want_q, **TOL[dtype])
    torch.testing.assert_close(got_k, want_k, **TOL[dtype])
    # Dims past rotary_dim pass through bit-exactly.
    assert torch.equal(got_q[..., rotary_dim:], q[..., rotary_dim:])


@requires_triton
@pytest.mark.parametrize("is_neox", [True, False])
def test_triton_strided_views_of_qkv(is_neox):
    T, H, Hkv, D = 3, 4, 2, 32
    cs, _ = _cache(10, D)
    qkv = torch.randn(T, (H + 2 * Hkv) * D, device=DEVICE)
    ref_in = qkv.clone()
    q = qkv[:, : H * D].view(T, H, D)
    k = qkv[:, H * D : (H + Hkv) * D].view(T, Hkv, D)
    pos = torch.tensor([1, 2, 9], device=DEVICE)
    want_q, want_k = apply_rotary_ref(q, k, pos, cs, D, is_neox)
    apply_rotary_triton(q, k, pos, cs, D, is_neox)
    torch.testing.assert_close(q, want_q, **TOL[torch.float32])
    torch.testing.assert_close(k, want_k, **TOL[torch.float32])
    assert torch.equal(qkv[:, (H + Hkv) * D :], ref_in[:, (H + Hkv) * D :])  # v untouched


@requires_triton
def test_triton_k_none_and_many_heads():
    cs, _ = _cache(8, 128)
    q = torch.randn(2, 96, 128, device=DEVICE)  # 96 heads of 128: two head blocks per token
    want_q, _ = apply_rotary_ref(q, None, torch.tensor([3, 5], device=DEVICE), cs, 128)
    got_q, got_k = apply_rotary_triton(q.clone(), None, torch.tensor([3, 5], device=DEVICE), cs, 128)
    assert got_k is None
    torch.testing.assert_close(got_q, want_q, **TOL[torch.float32])
