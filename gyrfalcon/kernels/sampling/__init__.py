"""Random draw of one token per row from (already temperature-scaled and masked) logits: Gumbel-max.

token[s] = argmax_i (z[s, i] + g(seed[s], offset[s], i)),   g = -log(-log(u)),  u ~ U(0, 1)

which draws token i with probability softmax(z[s])_i: no softmax, no normalization, masked entries
(-inf) never win. The uniforms come from a counter-based hash of (seed, offset, vocabulary index)
rather than a stateful generator, so
  - a draw needs no host sync and no per-row launch (a seeded request used to need its own generator
    call per step), and the GPU kernel and the CPU reference draw the same numbers;
  - a seeded request's draws depend only on its seed and the offset it passes (its output position),
    never on the batch around it.

z: [S, V] float; seeds, offsets: [S] int64 (>= 0). Returns [S] int64.

Hash: murmur3's 32-bit finalizer over the seed's two halves, the offset and the index; the top 24 bits
of the result make u = (k + 0.5) / 2^24, exactly representable in fp32 and never 0 or 1. Products are
taken mod 2^32 in 16-bit halves so that int64 arithmetic never overflows (same integers everywhere).
"""

from __future__ import annotations

import logging

import torch

from gyrfalcon.kernels.common import use_triton
from gyrfalcon.kernels.sampling.naive import gumbel_argmax_ref, hash_uniform_ref, row_keys
from gyrfalcon.kernels.sampling.triton import gumbel_argmax_triton


_TRITON_FAILED = False


def gumbel_argmax(z: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[S, V] logits, [S] seeds, [S] offsets -> [S] int64 tokens; see the module docstring.

    Every sampled request goes through here: if the Triton kernel cannot be built on this GPU, the
    reference (the same numbers, a few more launches) takes over, with a warning, rather than failing
    every request."""
    global _TRITON_FAILED
    if use_triton(z) and not _TRITON_FAILED:
        try:
            return gumbel_argmax_triton(z, seeds, offsets)
        except Exception as e:  # compilation / launch failure, not a data error
            _TRITON_FAILED = True
            logging.getLogger(__name__).warning("Triton sampling kernel unavailable (%s: %s); using the "
                                                "torch reference", type(e).__name__, e)
    return gumbel_argmax_ref(z, seeds, offsets)


__all__ = ["gumbel_argmax", "gumbel_argmax_ref", "gumbel_argmax_triton", "hash_uniform_ref", "row_keys"]
