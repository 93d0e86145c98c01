"""The gated MLP block (SwiGLU): gate_up projection, SiLU-and-mul, down projection."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from gyrfalcon.layers.activation import SiluAndMul
from gyrfalcon.layers.linear import MergedLinear, RowParallelLinear
from gyrfalcon.layers.norm import RMSNorm
from gyrfalcon.layers.norm_linear import NormLinear, project_out


class GatedMLP(nn.Module):
    """x [T, hidden] -> down_proj(silu(x W_gate^T) * (x W_up^T)) [T, hidden]; gate and up in one weight
    (shards 0 and 1 of gate_up_proj). The input norm is the decoder layer's; bind_input_norm pairs it with
    gate_up_proj and the activation (fused into one GEMV for single rows)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, {0: intermediate_size, 1: intermediate_size}, bias)
        self.act = SiluAndMul()
        # Tensor parallel: each rank holds a slice of the intermediate dim (gate_up column-, down row-parallel).
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias)
        self.gate_up_in: Optional[NormLinear] = None

    def bind_input_norm(self, norm: RMSNorm) -> None:
        self.gate_up_in = NormLinear(norm, self.gate_up_proj, self.act)

    def forward(self, hidden: Optional[torch.Tensor],
                residual: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
        """(hidden, residual): the residual stream (layers/norm_linear.py) -> the stream after this block."""
        n = self.gate_up_in(hidden, residual)
        return project_out(self.down_proj, n.y, n)
