"""RMSNorm, optionally fused with the residual add; also used for per-head q/k norm.

x: [..., hidden] (e.g. [num_tokens, hidden] or [num_tokens, num_heads, head_dim]); the norm runs over
the last dim. weight: [hidden] (or None for no affine; weight_offset is then ignored). Math is fp32; results
come back in x.dtype.
"""

from __future__ import annotations

import torch

from gyrfalcon.kernels.common import use_triton
from gyrfalcon.kernels.rms_norm.naive import apply_row_scale_ref, qk_norm_whole_ref, rms_norm_ref, row_rstd_ref
from gyrfalcon.kernels.rms_norm.triton import qk_norm_whole_triton, rms_norm_triton


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


def qk_norm_whole(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The whole-projection q and k RMSNorms of a fused qkv row (MiniMax-M2); see qk_norm_whole_ref."""
    if use_triton(qkv):
        return qk_norm_whole_triton(qkv, q_weight, k_weight, eps)
    return qk_norm_whole_ref(qkv, q_weight, k_weight, eps)


__all__ = ["apply_row_scale_ref", "qk_norm_whole", "qk_norm_whole_ref", "qk_norm_whole_triton", "rms_norm",
           "rms_norm_ref", "rms_norm_triton", "row_rstd_ref"]
