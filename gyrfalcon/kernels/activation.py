"""Gated activation for SwiGLU MLPs: silu(gate) * up.

x: [..., 2 * d] holding gate in x[..., :d] and up in x[..., d:]; returns [..., d] in x.dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gyrfalcon.kernels._common import HAS_TRITON, next_pow2, tl, triton, use_triton


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Plain-torch silu(x[..., :d]) * x[..., d:], fp32 math."""
    d = x.shape[-1] // 2
    xf = x.float()
    return (F.silu(xf[..., :d]) * xf[..., d:]).to(x.dtype)


if HAS_TRITON:

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, d, stride_x, BLOCK: tl.constexpr):
        # Grid: (num_rows, column blocks); gate and up halves of a row are read in one pass.
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < d
        g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * u
        tl.store(out_ptr + row * d + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton silu_and_mul; same contract as silu_and_mul_ref."""
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n_rows = x2.shape[0]
    if n_rows == 0 or d == 0:
        return out
    BLOCK = min(1024, max(16, next_pow2(d)))
    _silu_and_mul_kernel[(n_rows, triton.cdiv(d, BLOCK))](
        x2, out, d, x2.stride(0), BLOCK=BLOCK, num_warps=4
    )
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] -> [..., d]."""
    if use_triton(x):
        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)
