"""Fused q/k-norm + RoPE + KV store vs the composition of the unfused references."""

from __future__ import annotations

import pytest
import torch

from gyrfalcon.kernels.fused_qkv_prep import qkv_prep_ref, qkv_prep_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(T, H, KVH, D, rot, dtype, norm, nb=6, bs=4):
    g = torch.Generator().manual_seed(T * 131 + H + D)
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g).to(dtype).to(DEV)
    positions = torch.randint(0, 64, (T,), generator=g).to(DEV)
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    freqs = torch.outer(torch.arange(64).float(), inv)
    cs = torch.cat([freqs.cos(), freqs.sin()], -1).to(DEV)
    slots = torch.randperm(nb * bs, generator=g)[:T].to(DEV)
    slots[T // 2] = -1  # a padding token writes nothing
    qw = (1 + 0.3 * torch.randn(D, generator=g)).to(dtype).to(DEV) if norm else None
    kw = (1 + 0.3 * torch.randn(D, generator=g)).to(dtype).to(DEV) if norm else None
    caches = [torch.zeros(nb, bs, KVH, D, dtype=dtype, device=DEV) for _ in range(4)]
    return qkv, positions, cs, slots, qw, kw, caches


@pytest.mark.parametrize("T,H,KVH,D,rot", [(5, 4, 2, 32, 32), (3, 2, 1, 64, 32), (4, 4, 4, 16, 16),
                                           (2, 8, 2, 128, 128)])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_matches_unfused(T, H, KVH, D, rot, is_neox, norm, dtype):
    qkv, pos, cs, slots, qw, kw, (kc1, vc1, kc2, vc2) = _case(T, H, KVH, D, rot, dtype, norm)
    q_ref = qkv_prep_ref(qkv, H, KVH, D, pos, cs, rot, is_neox, kc1, vc1, slots, qw, kw, 1e-6)
    q_tri = qkv_prep_triton(qkv, H, KVH, D, pos, cs, rot, is_neox, kc2, vc2, slots, qw, kw, 1e-6)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(q_tri, q_ref, **tol)
    torch.testing.assert_close(kc2, kc1, **tol)
    torch.testing.assert_close(vc2, vc1, rtol=0, atol=0)
    assert q_tri.shape == (T, H, D)


@pytest.mark.parametrize("T,H,KVH,D,rot", [(5, 4, 2, 32, 32), (3, 6, 2, 64, 32), (2, 8, 2, 128, 128),
                                           (3, 3, 3, 16, 16)])
@pytest.mark.parametrize("heads", [2, 4, 8])
@pytest.mark.parametrize("norm", [True, False])
def test_several_heads_per_program(T, H, KVH, D, rot, heads, norm):
    """Programs that take `heads` heads of a token (prefill-sized batches), including groups that run past
    the last q or kv head (6 q heads in groups of 4, 2 kv heads in a group of 8)."""
    qkv, pos, cs, slots, qw, kw, (kc1, vc1, kc2, vc2) = _case(T, H, KVH, D, rot, torch.float32, norm)
    q_ref = qkv_prep_ref(qkv, H, KVH, D, pos, cs, rot, True, kc1, vc1, slots, qw, kw, 1e-6)
    q_tri = qkv_prep_triton(qkv, H, KVH, D, pos, cs, rot, True, kc2, vc2, slots, qw, kw, 1e-6, heads=heads)
    torch.testing.assert_close(q_tri, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kc2, kc1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(vc2, vc1, rtol=0, atol=0)


def test_heads_per_program_choice():
    from gyrfalcon.kernels.fused_qkv_prep import MULTI_HEAD_MIN_TOKENS, heads_per_program

    assert heads_per_program(1, 32) == 1 and heads_per_program(MULTI_HEAD_MIN_TOKENS - 1, 32) == 1
    assert heads_per_program(MULTI_HEAD_MIN_TOKENS, 32) == 8 and heads_per_program(8192, 2) == 2
    assert heads_per_program(8192, 6) == 8  # next power of two, capped


def test_ref_against_naive_math():
    """The reference itself: q head 0 of token 0 by hand (norm, then rotate_half)."""
    T, H, KVH, D = 1, 1, 1, 8
    qkv, pos, cs, slots, qw, kw, (kc, vc, _, _) = _case(T, H, KVH, D, D, torch.float32, True)
    slots[0] = 5
    q = qkv_prep_ref(qkv, H, KVH, D, pos, cs, D, True, kc, vc, slots, qw, kw, 1e-6)
    x = qkv[0, :D].cpu()
    xn = x * torch.rsqrt(x.pow(2).mean() + 1e-6) * qw.cpu()
    c, s = cs[pos[0], :D // 2].cpu(), cs[pos[0], D // 2:].cpu()
    want = torch.cat([xn[:4] * c - xn[4:] * s, xn[4:] * c + xn[:4] * s])
    torch.testing.assert_close(q[0, 0].cpu(), want)
    torch.testing.assert_close(vc[1, 1, 0].cpu(), qkv[0, 2 * D:].cpu())  # slot 5 = block 1, offset 1


@pytest.mark.parametrize("T,H,KVH,D,rot,heads", [(5, 4, 2, 32, 32, 1), (3, 6, 2, 64, 32, 4), (2, 2, 2, 16, 16, 1)])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group_major", [True, False], ids=["group-major", "token-major"])
def test_row_scale_matches_the_reference(T, H, KVH, D, rot, heads, norm, dtype, group_major):
    """Folded input norm (row_scale = (x, eps)): every q / k / v value scaled by its token's rstd(x) before the
    q/k norm and RoPE, v as stored too; hidden 100 (not a power of two) and 1500 (several row-sum chunks); the
    grid group-major (the default with a row scale) or token-major (past 65,535 tokens)."""
    from gyrfalcon.kernels.rms_norm import row_rstd_ref

    for hidden in (100, 1500):
        qkv, pos, cs, slots, qw, kw, (kc1, vc1, kc2, vc2) = _case(T, H, KVH, D, rot, dtype, norm)
        x = (torch.randn(T, hidden, generator=torch.Generator().manual_seed(hidden)) * 3).to(dtype).to(DEV)
        rs = (x, 1e-5)
        q_ref = qkv_prep_ref(qkv, H, KVH, D, pos, cs, rot, True, kc1, vc1, slots, qw, kw, 1e-6, row_scale=rs)
        q_tri = qkv_prep_triton(qkv, H, KVH, D, pos, cs, rot, True, kc2, vc2, slots, qw, kw, 1e-6, row_scale=rs,
                                heads=heads, group_major=group_major)
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(q_tri, q_ref, **tol)
        torch.testing.assert_close(kc2, kc1, **tol)
        torch.testing.assert_close(vc2, vc1, **tol)
        # the scale is applied: V in the cache is the raw v times rstd, not the raw v
        t = int((slots >= 0).nonzero()[0])
        v_raw = qkv[t, (H + KVH) * D:].view(KVH, D).float()
        s = int(slots[t])
        want_v = (v_raw * row_rstd_ref(x, 1e-5)[t]).to(dtype)
        torch.testing.assert_close(vc2[s // vc2.shape[1], s % vc2.shape[1]], want_v, **tol)
