"""Plain-torch SiLU-and-mul (the CPU path and the kernels' oracle); shapes in the package docstring."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gyrfalcon.kernels.rms_norm.naive import apply_row_scale_ref


def silu_and_mul_ref(x: torch.Tensor, row_scale=None) -> torch.Tensor:
    """Plain-torch silu(x[..., :d]) * x[..., d:], fp32 math."""
    d = x.shape[-1] // 2
    if row_scale is not None:
        x = apply_row_scale_ref(x, row_scale)
    xf = x.float()
    return (F.silu(xf[..., :d]) * xf[..., d:]).to(x.dtype)
