"""Launch shapes of the block-scaled FP8 GEMM, as data."""

from __future__ import annotations

from typing import NamedTuple


class Fp8GemmConfig(NamedTuple):
    """BLOCK_M token rows x BLOCK_N output columns a program; BLOCK_K is the weight's block width (128: one
    weight scale and one activation scale per loop step)."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def default_config(M: int, N: int, K: int) -> Fp8GemmConfig:
    """Decode-sized batches (<= 16 rows) stream the weight with narrow programs (many of them, to fill the SMs);
    larger batches use 64 x 128 tiles (tensor-core sized; fp8 tiles of 128 x 128 are 16 KB)."""
    if M <= 16:
        return Fp8GemmConfig(16, 64, 4, 4)
    if M <= 64:
        return Fp8GemmConfig(64, 64, 4, 4)
    return Fp8GemmConfig(64, 128, 4, 3)
