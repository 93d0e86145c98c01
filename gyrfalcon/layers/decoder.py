"""A pre-norm decoder layer: an attention slot and an MLP slot, each behind its own RMSNorm.

    stream -> input_layernorm -> self_attn -> (+) -> post_attention_layernorm -> mlp -> (+) -> stream

The slots take any block with bind_input_norm(norm) and forward(..., hidden, residual) -> (hidden, residual)
over the residual stream (layers/norm_linear.py): RotarySelfAttention and GatedMLP today, an MoE layer in the
MLP slot later. Each block runs its norm as the NormLinear it builds around its input projection decides (its
own kernel, fused into the GEMV, or folded into the weights), so the layer has one forward.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from gyrfalcon.layers.norm import RMSNorm


class DecoderLayer(nn.Module):
    def __init__(self, hidden_size: int, eps: float, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.mlp = mlp
        self_attn.bind_input_norm(self.input_layernorm)
        mlp.bind_input_norm(self.post_attention_layernorm)

    def forward(self, positions: torch.Tensor, hidden: Optional[torch.Tensor],
                residual: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
        """positions: [T]; (hidden, residual): the residual stream, [T, hidden] each or None (norm_linear.py)."""
        hidden, residual = self.self_attn(positions, hidden, residual)
        return self.mlp(hidden, residual)
