"""The block-scaled FP8 GEMM (kernels/fp8_gemm) under the interpreter (or on a GPU) against its dequantizing
reference, at small shapes with partial edge blocks; the weight quantizer's round trip."""

from __future__ import annotations

import pytest
import torch

from gyrfalcon.kernels.common import interpreting

from gyrfalcon.kernels.fp8_gemm import (Fp8GemmConfig, dequantize_weight, fp8_block_gemm,
                                        fp8_block_gemm_ref, fp8_block_gemm_triton, fp8_weight_only_ref,
                                        quantize_act, quantize_weight_blockwise, quantize_weight_per_channel)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _data(M, N, K, dtype):
    g = torch.Generator().manual_seed(M * 7919 + N * 31 + K)
    x = torch.randn(M, K, generator=g)
    x[:, :: 7] *= 8.0  # outlier columns: groups with different amax
    w = torch.randn(N, K, generator=g) / K ** 0.5
    w[: N // 3] *= 20.0  # blocks of different scale
    return x.to(dtype).to(DEV), w.to(DEV)


def _scale(x, wd):
    """The size of an output element: sum_k |x_k| |w_k| (errors of the fp8 path are relative to it)."""
    return (x.float().abs() @ wd.abs().t())


@pytest.mark.parametrize("M", [1, 5, 33])
@pytest.mark.parametrize("N,K", [(128, 128), (200, 384), (384, 200), (256, 256), (136, 264)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_gemm_matches_reference(M, N, K, dtype):
    x, w = _data(M, N, K, dtype)
    q, s = quantize_weight_blockwise(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (-(-N // 128), -(-K // 128)) and s.dtype == torch.float32
    y = fp8_block_gemm_triton(x, q, s, config=Fp8GemmConfig(16, 64, 4, 2))
    ref = fp8_block_gemm_ref(x, q, s)
    assert y.shape == (M, N) and y.dtype == dtype
    # Same quantized operands, fp32 accumulation in another order: fp32 rounding only, plus bf16's output
    # rounding. On a GPU an activation's division may land on the other side of an e4m3 rounding tie: one
    # element's 1/16 relative error, bounded by 2^-4 of its term; the atol covers a few such flips.
    mag = _scale(x, dequantize_weight(q, s)).max().item()
    tol = (1e-5 if interpreting() else 2e-3) * mag
    if dtype == torch.bfloat16:
        torch.testing.assert_close(y.float(), ref.float(), rtol=1e-2, atol=tol + 1e-2 * mag / 16)
    else:
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=tol)


@pytest.mark.parametrize("M", [1, 9])
@pytest.mark.parametrize("N,K", [(128, 200), (200, 384)])
def test_per_channel_matches_reference(M, N, K):
    x, w = _data(M, N, K, torch.float32)
    q, s = quantize_weight_per_channel(w)
    assert s.shape == (N, 1)
    y = fp8_block_gemm_triton(x, q, s, block=(1, K), config=Fp8GemmConfig(16, 32, 4, 2))
    ref = fp8_block_gemm_ref(x, q, s, block=(1, K))
    mag = _scale(x, dequantize_weight(q, s, (1, K))).max().item()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=(1e-5 if interpreting() else 2e-3) * mag)


def test_default_config_and_dispatch():
    x, w = _data(3, 200, 264, torch.float32)
    q, s = quantize_weight_blockwise(w)
    y = fp8_block_gemm_triton(x, q, s)  # default_config's launch
    torch.testing.assert_close(y, fp8_block_gemm_ref(x, q, s), rtol=1e-5,
                               atol=2e-3 * _scale(x, dequantize_weight(q, s)).max().item())
    # the dispatcher: the reference on CPU tensors, the kernel on CUDA ones
    torch.testing.assert_close(fp8_block_gemm(x, q, s), y, rtol=1e-3,
                               atol=2e-3 * _scale(x, dequantize_weight(q, s)).max().item())


def test_zero_rows_and_empty_batch():
    """All-zero rows (CUDA-graph padding) give zeros, not NaN; M = 0 gives an empty result."""
    x, w = _data(4, 128, 256, torch.float32)
    x[1] = 0.0
    q, s = quantize_weight_blockwise(w)
    y = fp8_block_gemm_triton(x, q, s)
    assert torch.isfinite(y).all() and (y[1] == 0).all()
    assert torch.isfinite(fp8_block_gemm_ref(x, q, s)).all()
    assert fp8_block_gemm_triton(x[:0], q, s).shape == (0, 128)


def test_activation_error_bound():
    """The kernel against the weight-only reference (unquantized activations): e4m3 rounds each activation to
    3 mantissa bits (relative error <= 2^-4), so |y - y_weight_only| <= 2^-4 * sum_k |x_k w_k| per element."""
    x, w = _data(6, 200, 384, torch.float32)
    q, s = quantize_weight_blockwise(w)
    y = fp8_block_gemm_triton(x, q, s)
    wd = dequantize_weight(q, s)
    bound = _scale(x, wd) / 16 + 1e-4
    assert ((y - fp8_weight_only_ref(x, q, s)).abs() <= bound).all()


@pytest.mark.parametrize("N,K", [(128, 128), (200, 384), (300, 136)])
def test_quantize_weight_round_trip(N, K):
    """Each element comes back within half an e4m3 step of its block's grid (relative 2^-4 of itself, or the
    subnormal step 2^-9 * scale near zero); each block's largest magnitude maps to 448 (its scale is amax / 448)."""
    g = torch.Generator().manual_seed(N + K)
    w = (torch.randn(N, K, generator=g) * torch.rand(N, 1, generator=g) * 3).to(torch.bfloat16)
    q, s = quantize_weight_blockwise(w)
    back = dequantize_weight(q, s)
    srow = s.repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
    err = (back - w.float()).abs()
    assert (err <= w.float().abs() / 16 + srow * 2.0 ** -9 + 1e-12).all()
    assert torch.allclose(q.float().abs().view(-1).max(), torch.tensor(448.0))
    # a dequantized weight quantizes back to itself (same amax, same scale, same e4m3 values)
    qq, ss = quantize_weight_blockwise(back)
    torch.testing.assert_close(dequantize_weight(qq, ss), back, rtol=0, atol=0)
    qa, sa = quantize_act(w.float(), 128)
    assert qa.shape == (N, K) and sa.shape == (N, -(-K // 128))


_COMPILE = """
import importlib, sys, torch
sys.path.insert(0, "scripts")
import compile_check as cc
try:
    mods, compiled = cc._harness(90)
except Exception:
    sys.exit(2)  # this Triton's internals do not allow the harness
for m in ("naive", "configs", "triton", ""):
    importlib.reload(importlib.import_module("gyrfalcon.kernels.fp8_gemm" + ("." + m if m else "")))
from gyrfalcon.kernels.fp8_gemm import fp8_block_gemm_triton
for N, K in [(6144, 4096), (4096, 14336), (200, 4000)]:
    for M in (1, 16, 64, 1024):
        x = torch.empty(M, K, dtype=torch.bfloat16)
        w = torch.empty(N, K, dtype=torch.float8_e4m3fn)
        fp8_block_gemm_triton(x, w, torch.empty(-(-N // 128), -(-K // 128)))
        fp8_block_gemm_triton(x, w, torch.empty(N, 1), (1, K))
for name, shared, nw, res, k in compiled:
    ptx = k.asm.get("ptx", "")
    print("KERNEL", shared, res.get("LOCAL", 0), int("e4m3" in ptx and "mma" in ptx))
"""


def test_compiles_for_sm90_with_fp8_tensor_cores():
    """Compile-only for sm_90 (scripts/compile_check.py's harness, in a subprocess): every launch shape of Llama-8B's
    linears fits the H200's shared memory, spills nothing and multiplies e4m3 operands on the tensor cores."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", _COMPILE], cwd=root, capture_output=True, text=True, timeout=600,
                       env=env)
    if r.returncode == 2:
        pytest.skip("this Triton does not allow the compile-only harness")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line.split()[1:] for line in r.stdout.splitlines() if line.startswith("KERNEL")]
    assert len(rows) == 24
    for shared, local, fp8_mma in rows:
        assert int(shared) <= 232448 and int(local) == 0 and int(fp8_mma) == 1
