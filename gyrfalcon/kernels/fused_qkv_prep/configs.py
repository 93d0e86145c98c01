"""Heads per program of the qkv-prep launch, from the token count."""

from __future__ import annotations

from gyrfalcon.kernels.common import next_pow2


# Tokens from which a program takes several heads (prefill): one head per program leaves ~400k one-warp
# programs for 8k tokens of Llama-8B, latency-bound at ~4x the bytes' time.
MULTI_HEAD_MIN_TOKENS = 256
MAX_HEADS_PER_PROGRAM = 8


def heads_per_program(num_tokens: int, num_heads: int) -> int:
    """Heads each program takes: 1 for small batches (decode-sized: more programs, more parallelism),
    up to MAX_HEADS_PER_PROGRAM from MULTI_HEAD_MIN_TOKENS tokens (qkv_prep_triton's `heads` overrides it)."""
    if num_tokens < MULTI_HEAD_MIN_TOKENS:
        return 1
    return min(MAX_HEADS_PER_PROGRAM, next_pow2(num_heads))
