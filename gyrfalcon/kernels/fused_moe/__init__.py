"""Fused mixture-of-experts: each token's top-k experts' SwiGLU MLPs, weighted and summed, in few launches.

fused_moe(x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k] fp32, topk_ids [T, k] int) -> [T, H];
FP8 experts add w13_scale [E, ceil(2I / bn), ceil(H / bk)] and w2_scale [E, ceil(H / bn), ceil(I / bk)] (fp32,
e4m3 weights, block (bn, bk)); expert_start: the global id of w13's first expert under expert parallelism (the op
then computes only the pairs routed to its E experts). naive.py has the exact contract. The Triton path (triton.py:
sort + two grouped GEMMs + a top-k sum) runs on CUDA tensors (unless GYRFALCON_KERNELS=ref), the reference
otherwise.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from gyrfalcon.kernels.common import use_triton
from gyrfalcon.kernels.fused_moe.configs import MoeConfig, default_config, fp8_config
from gyrfalcon.kernels.fused_moe.naive import fused_moe_ref
from gyrfalcon.kernels.fused_moe.triton import fused_moe_triton, moe_align


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, w13_scale: Optional[torch.Tensor] = None,
              w2_scale: Optional[torch.Tensor] = None, block: Tuple[int, int] = (128, 128),
              expert_start: int = 0, total_experts: Optional[int] = None) -> torch.Tensor:
    """fused_moe_triton on CUDA tensors, else the reference (same contract; total_experts, the model's expert count
    under expert parallelism, only tunes the Triton launch)."""
    if use_triton(x):
        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block,
                                expert_start=expert_start, total_experts=total_experts)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block, expert_start)


__all__ = ["MoeConfig", "default_config", "fp8_config", "fused_moe", "fused_moe_ref", "fused_moe_triton",
           "moe_align"]
