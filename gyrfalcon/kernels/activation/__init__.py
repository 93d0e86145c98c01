"""Gated activation for SwiGLU MLPs: silu(gate) * up.

x: [..., 2 * d] holding gate in x[..., :d] and up in x[..., d:]; returns [..., d] in x.dtype.
row_scale = (r [T, hidden], eps) (x 2-D): gate and up first scaled by each row's rstd(r), for the
post-attention norm folded into the gate_up GEMM (rms_norm.apply_row_scale_ref).
"""

from __future__ import annotations

import torch

from gyrfalcon.kernels.activation.naive import silu_and_mul_ref
from gyrfalcon.kernels.activation.triton import silu_and_mul_triton
from gyrfalcon.kernels.common import use_triton


def silu_and_mul(x: torch.Tensor, row_scale=None) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] -> [..., d] (row_scale: see the module docstring)."""
    if use_triton(x):
        return silu_and_mul_triton(x, row_scale)
    return silu_and_mul_ref(x, row_scale)


__all__ = ["silu_and_mul", "silu_and_mul_ref", "silu_and_mul_triton"]
