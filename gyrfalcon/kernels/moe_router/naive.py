"""Plain-torch reference of the MoE router's selection: router logits -> (topk_weights, topk_ids).

logits [T, E] (any float dtype; computed in fp32 here, as transformers does) ->
  (weights [T, k] fp32, ids [T, k] int64), the chosen experts in descending order of their selection score.
- "softmax": p = softmax(logits); ids = top-k of p; weights = p[ids], divided by their sum when norm_topk_prob
  (Qwen3-MoE, Qwen3-Next, Qwen3.5).
- "sigmoid": s = sigmoid(logits); ids = top-k of s + bias (the bias, e_score_correction_bias [E] fp32, only
  selects); weights = s[ids], divided by (their sum + 1e-20) when norm_topk_prob (MiniMax-M2, DeepSeek-V3).
  n_group > 1 (DeepSeek's noaux_tc): each of n_group groups of E / n_group experts scores the sum of its top-2
  biased scores, the topk_group best groups stay, the top-k experts are picked among theirs.
Both scale the weights by routed_scaling_factor (1.0: none).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

SOFTMAX, SIGMOID = "softmax", "sigmoid"


def route_ref(logits: torch.Tensor, top_k: int, scoring: str = SOFTMAX, norm_topk_prob: bool = True,
              bias: Optional[torch.Tensor] = None, n_group: int = 1, topk_group: int = 1,
              routed_scaling_factor: float = 1.0) -> Tuple[torch.Tensor, torch.Tensor]:
    logits = logits.float()
    E = logits.shape[-1]
    if scoring == SOFTMAX:
        probs = logits.softmax(dim=-1)
        weights, ids = probs.topk(top_k, dim=-1)
        if norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        scores = logits.sigmoid()
        choice = scores if bias is None else scores + bias.float()
        if n_group > 1:
            T = choice.shape[0]
            grouped = choice.view(T, n_group, E // n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, n_group]
            keep = group_scores.topk(topk_group, dim=-1).indices
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = choice.masked_fill(~group_mask.repeat_interleave(E // n_group, dim=1), float("-inf"))
        ids = choice.topk(top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights, ids
