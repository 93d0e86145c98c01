"""RMSNorm, with the residual add fused into the same kernel, and the fold of its weight into a GEMM."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from gyrfalcon.kernels import rms_norm


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * (weight + weight_offset), in fp32.

    weight_offset=1 gives the zero-centred norm of Qwen3-Next (`* (1 + w)`).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, weight_offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.weight_offset = weight_offset
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """x: [..., hidden]. With a residual returns (norm(x + residual), x + residual)."""
        return rms_norm(x, self.weight, self.eps, residual=residual, weight_offset=self.weight_offset)


def fold_norm_into(weight: torch.Tensor, norm: RMSNorm) -> None:
    """weight [N, K] <- weight * (norm.weight + weight_offset) over K, in fp32 and rounded once; the norm's
    weight becomes ones (offset 0 included), so rms_norm(x) @ weight^T is unchanged wherever the norm still
    runs (the fused norm + GEMV of single rows)."""
    g = norm.weight.float() + norm.weight_offset
    weight.data.copy_((weight.data.float() * g[None, :]).to(weight.dtype))
    norm.weight.data.fill_(1.0 - norm.weight_offset)
