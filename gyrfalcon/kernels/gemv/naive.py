"""The unfused composition [residual add +] RMSNorm -> linear -> [SiLU-and-mul]: the kernel's oracle (and the CPU
path); shapes in the package docstring."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from gyrfalcon.kernels.activation.naive import silu_and_mul_ref
from gyrfalcon.kernels.rms_norm.naive import rms_norm_ref


def norm_gemv_ref(x: torch.Tensor, weight: torch.Tensor, norm_weight: Optional[torch.Tensor] = None,
                  residual: Optional[torch.Tensor] = None, eps: float = 1e-6,
                  silu_mul: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The unfused composition: [residual add +] RMSNorm -> linear -> [silu_and_mul]."""
    new_residual = None
    if norm_weight is not None:
        if residual is not None:
            x, new_residual = rms_norm_ref(x, norm_weight, eps, residual=residual)
        else:
            x = rms_norm_ref(x, norm_weight, eps)
    y = F.linear(x, weight)
    if silu_mul:
        y = silu_and_mul_ref(y)
    return y, new_residual
