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


H200_SMS = 132


def default_config(M: int, N: int, K: int) -> Fp8GemmConfig:
    """Decode-sized batches (<= 16 rows) stream the weight: narrow programs, 32 columns where 64 would leave fewer
    than two programs per SM of the H200 (Llama-8B's qkv / o / down at N 4096-6144), else 64. Larger batches use
    64 x 64 and then 64 x 128 tiles (tensor-core sized; a 128 x 128 fp8 weight tile is 16 KB a stage).
    Not yet timed on a GPU: a first rule, checked only to compile for sm_90 without spills."""
    if M <= 16:
        return Fp8GemmConfig(16, 32 if -(-N // 64) < 2 * H200_SMS else 64, 4, 4)
    if M <= 64:
        return Fp8GemmConfig(64, 64, 4, 4)
    return Fp8GemmConfig(64, 128, 4, 3)
