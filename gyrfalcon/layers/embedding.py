"""Token embedding and the LM head (tied to the embedding or not), both vocab-parallel under tensor parallelism.

Tensor parallel (gyrfalcon/distributed): rank r holds vocabulary rows [r * P, (r + 1) * P), P = ceil(vocab / tp)
(the last rank's rows past the vocabulary are zeros). The embedding looks up the ids in its range, zeros the
others' rows and all-reduces (each id is in exactly one rank's range); the LM head computes its rows' logits and
all-gathers them, so every rank samples from the same full [N, vocab] logits and keeps the same tokens.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from gyrfalcon.distributed import tp_all_gather, tp_all_reduce, tp_rank, tp_size
from gyrfalcon.kernels.embedding import embedding_with_pending


def _vocab_rows(vocab_size: int) -> int:
    """The rows of the vocabulary each rank holds (all of them at world size 1)."""
    return -(-vocab_size // tp_size())


def load_vocab_shard(param: nn.Parameter, loaded: torch.Tensor, vocab_size: int) -> None:
    """Checkpoint tensor [vocab, hidden] -> this rank's rows of `param` [P, hidden], zeros past the vocabulary."""
    if loaded.dim() != 2 or loaded.shape[0] != vocab_size or loaded.shape[1] != param.shape[1]:
        raise ValueError(f"Shape mismatch: a [{vocab_size}, {param.shape[1]}] vocabulary matrix vs checkpoint "
                         f"{tuple(loaded.shape)}.")
    rows = param.shape[0]
    start = tp_rank() * rows
    n = max(0, min(vocab_size, start + rows) - start)
    param.data[:n].copy_(loaded.narrow(0, start, n))
    param.data[n:].zero_()


class VocabEmbedding(nn.Module):
    """ids: [num_tokens] -> [num_tokens, hidden]. With src / last_sampled (decode graphs): a token whose
    src is >= 0 is still on the device, last_sampled[src] (kernels/embedding.py). weight: this rank's rows
    [P, hidden] (module docstring)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        rows = _vocab_rows(vocab_size)
        self.vocab_start = tp_rank() * rows
        self.weight = nn.Parameter(torch.empty(rows, hidden_size), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        load_vocab_shard(param, loaded, self.vocab_size)

    def forward(self, ids: torch.Tensor, src: Optional[torch.Tensor] = None,
                last_sampled: Optional[torch.Tensor] = None) -> torch.Tensor:
        if tp_size() > 1:
            return self._forward_parallel(ids, src, last_sampled)
        if src is None:
            return F.embedding(ids, self.weight)
        return embedding_with_pending(self.weight, ids, src, last_sampled)

    def _forward_parallel(self, ids: torch.Tensor, src: Optional[torch.Tensor],
                          last_sampled: Optional[torch.Tensor]) -> torch.Tensor:
        if src is not None:  # the tokens still on the device first, then the masked lookup
            ids = torch.where(src >= 0, last_sampled[src.clamp(min=0)], ids)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return tp_all_reduce(out)


class LMHead(nn.Module):
    """hidden: [num_tokens, hidden] -> logits [num_tokens, vocab], fp32 unless fp32=False (the weight's
    dtype: enough for a greedy argmax or a Gumbel draw, whose answers the exact fp32 conversion cannot
    change, and one conversion kernel less per decode step). weight: this rank's vocabulary rows (tied: the
    embedding's, which split the same way)."""

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(_vocab_rows(vocab_size), hidden_size), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        load_vocab_shard(param, loaded, self.vocab_size)

    def forward(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        if tp_size() > 1:
            logits = tp_all_gather(logits)
            if logits.shape[-1] != self.vocab_size:  # the last rank's padding rows
                logits = logits[:, :self.vocab_size].contiguous()
        return logits.float() if fp32 else logits
