"""The torch composition of embedding_with_pending (the CPU path and the kernel's oracle)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def embedding_with_pending_ref(weight: torch.Tensor, input_ids: torch.Tensor, src: torch.Tensor,
                               last_sampled: torch.Tensor) -> torch.Tensor:
    """The torch composition (what the decode graphs ran before this kernel)."""
    ids = torch.where(src >= 0, last_sampled[src.clamp(min=0)], input_ids)
    return F.embedding(ids, weight)
