"""Triton SiLU-and-mul, with the folded post-attention norm's row scale (row_scale) or without."""

from __future__ import annotations

import torch

from gyrfalcon.kernels.common import HAS_TRITON, next_pow2, tl, triton


if HAS_TRITON:
    from gyrfalcon.kernels.rms_norm.triton import _row_rstd

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

    @triton.jit
    def _silu_and_mul_scaled_kernel(x_ptr, out_ptr, d, stride_x, r_ptr, stride_r, eps, BLOCK: tl.constexpr,
                                    HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr):
        # Grid: (num_rows, column programs). The row's rstd from its row of r, once per program; program c
        # then takes column blocks c, c + P, ... (P = the grid's second axis), so a long batch (a prefill)
        # runs one program per row and reads each row of r once.
        row = tl.program_id(0)
        scale = _row_rstd(r_ptr + row.to(tl.int64) * stride_r, eps, HIDDEN, BLOCK_H)
        for c0 in range(tl.program_id(1) * BLOCK, d, tl.num_programs(1) * BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            mask = cols < d
            g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32) * scale
            u = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32) * scale
            y = g / (1.0 + tl.exp(-g)) * u
            tl.store(out_ptr + row * d + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


# With a row scale, programs per row aim at ~4 waves of the H200's 132 SMs in all (each reads its row of r).
_ROW_SCALE_PROGRAMS = 528


def silu_and_mul_triton(x: torch.Tensor, row_scale=None) -> torch.Tensor:
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
    if row_scale is None:
        _silu_and_mul_kernel[(n_rows, triton.cdiv(d, BLOCK))](
            x2, out, d, x2.stride(0), BLOCK=BLOCK, num_warps=4
        )
        return out
    r, eps = row_scale
    assert r.dim() == 2 and r.shape[0] == n_rows and r.stride(-1) == 1
    cols = max(1, min(triton.cdiv(d, BLOCK), triton.cdiv(_ROW_SCALE_PROGRAMS, n_rows)))
    _silu_and_mul_scaled_kernel[(n_rows, cols)](
        x2, out, d, x2.stride(0), r, r.stride(0), float(eps), BLOCK=BLOCK, HIDDEN=r.shape[-1],
        BLOCK_H=min(1024, max(16, next_pow2(r.shape[-1]))), num_warps=4,
    )
    return out
