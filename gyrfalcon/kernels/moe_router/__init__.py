"""The MoE router's selection (scores, top-k, normalization, scaling): router logits [T, E] -> (topk_weights [T, k]
fp32, topk_ids [T, k] int64). naive.py has the exact contract; triton.py does it in one launch per step on CUDA
tensors (unless GYRFALCON_KERNELS=ref) for every case but DeepSeek's grouped selection (n_group > 1)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from gyrfalcon.kernels.common import use_triton
from gyrfalcon.kernels.moe_router.naive import SIGMOID, SOFTMAX, route_ref
from gyrfalcon.kernels.moe_router.triton import MAX_EXPERTS, MAX_TOP_K, route_triton


def route(logits: torch.Tensor, top_k: int, scoring: str = SOFTMAX, norm_topk_prob: bool = True,
          bias: Optional[torch.Tensor] = None, n_group: int = 1, topk_group: int = 1,
          routed_scaling_factor: float = 1.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """route_triton where it applies (CUDA, n_group 1, E <= 1024, k <= 16), else route_ref."""
    E = logits.shape[-1]
    if use_triton(logits) and n_group == 1 and E <= MAX_EXPERTS and top_k <= MAX_TOP_K:
        return route_triton(logits, top_k, scoring, norm_topk_prob, bias, routed_scaling_factor)
    return route_ref(logits, top_k, scoring, norm_topk_prob, bias, n_group, topk_group, routed_scaling_factor)


__all__ = ["SIGMOID", "SOFTMAX", "route", "route_ref", "route_triton"]
