"""The draft vocabulary: the draft's LM head scores only the target tokens that matter in the data.

The formats map a draft id i to the target id i + d2t[i] (d2t: [V_draft] int64 offsets, the draft ids in ascending
target order) and mark the chosen target ids in t2d ([V_target] bool)."""

from __future__ import annotations

from typing import Iterable, Sequence, Tuple

import torch


def choose_draft_vocab(sequences: Iterable[Sequence[int]], vocab_size: int, draft_vocab_size: int) -> torch.Tensor:
    """The draft_vocab_size most frequent target ids over `sequences` (ties and unseen ids by ascending id, so the
    choice is deterministic), sorted ascending: [V_draft] int64."""
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size must be in [1, {vocab_size}] (the target's vocabulary), "
                         f"got {draft_vocab_size}.")
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for ids in sequences:
        t = torch.as_tensor(list(ids), dtype=torch.int64)
        if len(t) and (int(t.max()) >= vocab_size or int(t.min()) < 0):
            raise ValueError(f"A token id outside the target's vocabulary of {vocab_size}.")
        counts += torch.bincount(t, minlength=vocab_size)
    # Stable sort on -count keeps ascending ids among equal counts.
    order = torch.sort(-counts, stable=True).indices
    return order[:draft_vocab_size].sort().values


def d2t_t2d(draft_ids: torch.Tensor, vocab_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """draft_ids: [V_draft] ascending target ids -> (d2t [V_draft] int64 offsets, t2d [V_target] bool)."""
    d2t = draft_ids - torch.arange(len(draft_ids), dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    return d2t, t2d
