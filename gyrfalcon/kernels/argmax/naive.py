"""torch's argmax: the reference (and the path from TORCH_MIN_ROWS rows on)."""

from __future__ import annotations

import torch


def greedy_argmax_ref(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)
