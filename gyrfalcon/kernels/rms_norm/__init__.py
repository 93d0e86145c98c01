"""RMSNorm, optionally fused with the residual add; also used for per-head q/k norm.

x: [..., hidden] (e.g. [num_tokens, hidden] or [num_tokens, num_heads, head_dim]); the norm runs over
the last dim. weight: [hidden] (or None for no affine; weight_offset is then ignored). Math is fp32; results
come back in x.dtype.
"""

from __future__ import annotations

import torch

from gyrfalcon.kernels.common import use_triton
from gyrfalcon.kernels.rms_norm.naive import apply_row_scale_ref, rms_norm_ref, row_rstd_ref
from gyrfalcon.kernels.rms_norm.triton import rms_norm_triton


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    weight_offset: float = 0.0,
):
    """RMSNorm (+ fused residual add). Triton on CUDA, reference elsewhere; see rms_norm_ref."""
    if use_triton(x):
        return rms_norm_triton(x, weight, eps, residual, weight_offset=weight_offset)
    return rms_norm_ref(x, weight, eps, residual, weight_offset=weight_offset)


__all__ = ["apply_row_scale_ref", "rms_norm", "rms_norm_ref", "rms_norm_triton", "row_rstd_ref"]
