"""Gated activations."""

import torch
from torch import nn

from gyrfalcon.kernels import silu_and_mul


class SiluAndMul(nn.Module):
    """x: [num_tokens, 2 * d] (gate | up) -> silu(gate) * up: [num_tokens, d]"""

    def forward(self, x: torch.Tensor, row_scale=None) -> torch.Tensor:
        """row_scale: (r [T, hidden], eps): gate and up scaled by each row's rstd(r) first (folded norms)."""
        return silu_and_mul(x, row_scale)
