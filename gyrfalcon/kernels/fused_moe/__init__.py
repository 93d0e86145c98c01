"""Fused mixture-of-experts: each token's top-k experts' SwiGLU MLPs, weighted and summed, in few launches.

fused_moe(x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k] fp32, topk_ids [T, k] int) -> [T, H];
naive.py has the exact contract. The Triton path runs on CUDA tensors (unless GYRFALCON_KERNELS=ref), the
reference otherwise.
"""

from __future__ import annotations

import torch

from gyrfalcon.kernels.common import use_triton
from gyrfalcon.kernels.fused_moe.naive import fused_moe_ref

try:
    from gyrfalcon.kernels.fused_moe.triton import fused_moe_triton
except ImportError:  # the Triton op is not built yet
    fused_moe_triton = None


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    if fused_moe_triton is not None and use_triton(x):
        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids)


__all__ = ["fused_moe", "fused_moe_ref", "fused_moe_triton"]
