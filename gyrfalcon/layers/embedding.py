"""Token embedding and the LM head (tied to the embedding or not)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from gyrfalcon.kernels.embedding import embedding_with_pending


class VocabEmbedding(nn.Module):
    """ids: [num_tokens] -> [num_tokens, hidden]. With src / last_sampled (decode graphs): a token whose
    src is >= 0 is still on the device, last_sampled[src] (kernels/embedding.py)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, ids: torch.Tensor, src: Optional[torch.Tensor] = None,
                last_sampled: Optional[torch.Tensor] = None) -> torch.Tensor:
        if src is None:
            return F.embedding(ids, self.weight)
        return embedding_with_pending(self.weight, ids, src, last_sampled)


class LMHead(nn.Module):
    """hidden: [num_tokens, hidden] -> logits [num_tokens, vocab], fp32 unless fp32=False (the weight's
    dtype: enough for a greedy argmax or a Gumbel draw, whose answers the exact fp32 conversion cannot
    change, and one conversion kernel less per decode step)."""

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None) -> None:
        super().__init__()
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        return logits.float() if fp32 else logits
