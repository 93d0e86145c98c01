"""Token embedding lookup that first resolves tokens still on the device, in one launch.

A decode step scheduled ahead of the device (async scheduling) does not know the token each sequence
sampled in the step before; the runner's `last_sampled` buffer holds it on the device, and `src` says
which row of it each token takes. In torch that is clamp, index, compare, where, then the embedding
gather: five kernels of ~1-2 us each in every decode graph (and F.embedding's indexSelectSmallIndex
took 12 us for 16 rows on the H200). Here one program per
(token, column block) picks the token id and copies its row.

weight: [V, H]; input_ids: [T] int64; src: [T] int64 (-1: take input_ids[t], else last_sampled[src[t]]);
last_sampled: [S] int64. Returns [T, H] in weight.dtype.
"""

from __future__ import annotations

import torch

from gyrfalcon.kernels.common import use_triton
from gyrfalcon.kernels.embedding.naive import embedding_with_pending_ref
from gyrfalcon.kernels.embedding.triton import embedding_with_pending_triton


def embedding_with_pending(weight: torch.Tensor, input_ids: torch.Tensor, src: torch.Tensor,
                           last_sampled: torch.Tensor) -> torch.Tensor:
    if use_triton(weight):
        return embedding_with_pending_triton(weight, input_ids, src, last_sampled)
    return embedding_with_pending_ref(weight, input_ids, src, last_sampled)


__all__ = ["embedding_with_pending", "embedding_with_pending_ref", "embedding_with_pending_triton"]
