import pytest
import torch

from gyrfalcon.kernels.store_kv import store_kv_ref, store_kv_triton
from kernels_testutil import DEVICE, DTYPES, requires_triton


def _naive(k, v, k_cache, v_cache, slots):
    bs = k_cache.shape[1]
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            k_cache[s // bs, s % bs] = k[t]
            v_cache[s // bs, s % bs] = v[t]


def _case(dtype, n_kv=2, dk=16, dv=16, num_blocks=6, block_size=4, device=DEVICE):
    slots = torch.tensor([5, -1, 0, 23, 13, -1, 8], device=device)
    T = slots.shape[0]
    k = torch.randn(T, n_kv, dk, device=device).to(dtype)
    v = torch.randn(T, n_kv, dv, device=device).to(dtype)
    kc = torch.randn(num_blocks, block_size, n_kv, dk, device=device).to(dtype)
    vc = torch.randn(num_blocks, block_size, n_kv, dv, device=device).to(dtype)
    return k, v, kc, vc, slots


def test_ref_matches_naive():
    k, v, kc, vc, slots = _case(torch.float32, device="cpu")
    kc2, vc2 = kc.clone(), vc.clone()
    store_kv_ref(k, v, kc, vc, slots)
    _naive(k, v, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_kv,dk,dv", [(2, 16, 16), (1, 64, 64), (4, 32, 24), (2, 256, 256)])
def test_triton_matches_ref(dtype, n_kv, dk, dv):
    k, v, kc, vc, slots = _case(dtype, n_kv, dk, dv)
    kc2, vc2 = kc.clone(), vc.clone()
    store_kv_ref(k, v, kc, vc, slots)
    store_kv_triton(k, v, kc2, vc2, slots)
    # Pure copies: exact equality, including untouched slots (skipped -1 tokens wrote nothing).
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


@requires_triton
def test_triton_strided_inputs_and_cast():
    # k/v sliced out of a fused qkv output; fp32 activations into a bf16 cache.
    T, H, Hkv, D = 4, 4, 2, 16
    qkv = torch.randn(T, (H + 2 * Hkv) * D, device=DEVICE)
    k = qkv[:, H * D : (H + Hkv) * D].view(T, Hkv, D)
    v = qkv[:, (H + Hkv) * D :].view(T, Hkv, D)
    kc = torch.zeros(3, 4, Hkv, D, device=DEVICE, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    kc2, vc2 = kc.clone(), vc.clone()
    slots = torch.tensor([2, 7, -1, 11], device=DEVICE)
    store_kv_ref(k, v, kc, vc, slots)
    store_kv_triton(k, v, kc2, vc2, slots)
    # The interpreter truncates fp32 -> bf16 where torch rounds: allow one bf16 ulp.
    torch.testing.assert_close(kc2, kc, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(vc2, vc, atol=1e-2, rtol=1e-2)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_fp8_cache(dtype):
    """kv_cache_dtype fp8: K/V are rounded to float8 e4m3 on the way in. Inputs exactly representable in
    e4m3 (the Triton interpreter rounds some other values wrongly; tests/gpu covers rounding): the stored
    bytes equal torch's conversion, and nothing else changes."""
    k, v, kc, vc, slots = _case(torch.float32)
    fp8 = torch.float8_e4m3fn
    k, v = k.to(fp8).to(dtype), v.to(fp8).to(dtype)
    kc8, vc8 = kc.to(fp8), vc.to(fp8)
    kr, vr = kc8.clone(), vc8.clone()
    store_kv_ref(k, v, kr, vr, slots)
    store_kv_triton(k, v, kc8, vc8, slots)
    assert torch.equal(kc8.view(torch.uint8), kr.view(torch.uint8))
    assert torch.equal(vc8.view(torch.uint8), vr.view(torch.uint8))
