"""The GEMV's launch shapes and routing: which rows go through it, and the launch shape of a (rows, N, K) problem
(default_config's rule, with tables of (N, K) shapes tuned on the H200 as data)."""

from __future__ import annotations

from typing import NamedTuple, Tuple

from gyrfalcon.kernels.common import H200_MAX_SHARED, next_pow2


MAX_M = 64  # rows one program's tile holds (BLOCK_M: 1, else 16, 32 or 64)


class GemvConfig(NamedTuple):
    """Launch shape: BLOCK_N output columns per program, BLOCK_K inputs per loop step."""
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


ONE_PASS_B1_MAX_K = 1024  # the widest single row that applies its norm after the dot (one_pass_norm_b1)


def one_pass_norm_b1(K: int, block_k: int) -> bool:
    """Whether a single row of K inputs with a norm, in tiles of block_k, scales by rstd after the dot (ONE_PASS)
    instead of a first pass over the row: when one tile covers a row of up to ONE_PASS_B1_MAX_K inputs. With the
    row in one tile the row's sum of squares and its dot with the weight (already in registers under PDL) then
    reduce side by side after the wait instead of one after the other: one block-wide reduction fewer on the
    path after each wait of the batch-1 chain (faster at Qwen3-0.6B's K = 1024; at Llama-8B's K = 4096 it lost,
    its qkv launch short of registers). Rounds x * norm_weight to the weight dtype where the first pass rounds
    the normed row. Launches of 2+ rows with a norm always take ONE_PASS (the first pass is a chain of loads
    ahead of the first weight tile)."""
    return block_k >= K and K <= ONE_PASS_B1_MAX_K


# Rows up to which the models route a linear layer with a norm in front (qkv, gate_up) through this kernel
# instead of the RMSNorm kernel and cuBLAS: the single-row path ran 1.03-3.25x faster than RMSNorm + cuBLAS on
# Qwen3-0.6B and Llama-3.1-8B shapes on the H200; the fused norm lost to cuBLAS at 4-64 rows.
GEMV_MAX_ROWS = 1


# Rows up to which a linear layer without a norm in front (o_proj, down_proj) goes through this kernel: its
# tensor-core path with 32-column tiles and 4 stages beat cuBLAS (+ its split-K reduce) at 16 rows on the H200,
# in the sweep and in whole batch-16 decode steps.
PLAIN_MAX_ROWS = 16


def norm_gemv_rows() -> Tuple[int, int]:
    """(qkv, gate_up): rows up to which a decoder layer runs [residual add +] RMSNorm + that projection through
    this kernel (one launch) instead of the RMSNorm kernel and cuBLAS: GEMV_MAX_ROWS for both."""
    return GEMV_MAX_ROWS, GEMV_MAX_ROWS


WHOLE_ROW_MAX_BYTES = 64 * 1024  # one program's weight slice in registers: 8 x 4096 bf16 = 64 a thread at 8 warps


# Launch shapes (rows a program, warps) of the peeled (PDL) single-row launches of these (N outputs, K inputs),
# Qwen3-0.6B's, chosen in the batch-1 chain rather than one launch at a time: fewer rows a program (2x the
# programs) and fewer warps shorten what each program does after its PDL wait (in a launch alone the defaults
# streamed faster). {(N, K): (BLOCK_N, num_warps)}; N counts SiLU-and-mul's units.
B1_CHAIN_SHAPES = {(4096, 1024): (4, 2), (1024, 2048): (4, 4), (3072, 1024): (8, 2), (1024, 3072): (4, 8)}


# Launch shapes of the tensor-core path (2..PLAIN_MAX_ROWS rows) for these (N outputs, K inputs) in place of
# default_config's; a MergedLinear (qkv, gate_up) of a listed shape also leaves cuBLAS for this kernel at those
# rows. Llama-3.1-8B's down_proj, qkv and o_proj at 16 rows, from the H200 sweep (benchmarks/small_m_gemv.py
# --wide): each at or below cuBLAS.
ROWS_SHAPES: dict = {(4096, 14336): GemvConfig(32, 512, 4, 4), (6144, 4096): GemvConfig(64, 128, 4, 6),
                     (4096, 4096): GemvConfig(32, 512, 4, 4)}


# Launch shapes for PLAIN_MAX_ROWS + 1..MAX_M rows; a linear layer of a listed (N, K) goes through this kernel up to
# MAX_M rows instead of cuBLAS. Llama-3.1-8B's down_proj at 64 rows beat cuBLAS plus its split-K reduce on the
# H200; its o_proj and qkv stayed slower.
WIDE_ROWS_SHAPES: dict = {(4096, 14336): GemvConfig(32, 256, 4, 4)}


def linear_gemv_rows(n: int, k: int, merged: bool) -> int:
    """Rows up to which a bias-free linear layer of n outputs over k inputs runs on this kernel instead of cuBLAS:
    MAX_M for a shape with a wide launch shape of its own (WIDE_ROWS_SHAPES); else PLAIN_MAX_ROWS for a norm-less
    Linear and for a MergedLinear (qkv, gate_up) listed in ROWS_SHAPES; else single rows."""
    if (n, k) in WIDE_ROWS_SHAPES:
        return MAX_M
    if not merged or (n, k) in ROWS_SHAPES:
        return PLAIN_MAX_ROWS
    return GEMV_MAX_ROWS


def default_config(M: int, N: int, K: int, silu_mul: bool = False, elem_size: int = 2,
                   whole_row: bool = False, max_shared: int = H200_MAX_SHARED) -> GemvConfig:
    """A launch shape from the problem shape only (CUDA-graph safe: no autotuning at capture).

    A GEMV at batch 1 is a stream over the weight: many narrow programs (8 rows each: 128-1024
    programs at these shapes), each keeping long rows (1024 inputs) in flight through a 3-stage
    pipeline, was the H200 sweep's best or within 5% of it on every shape. Stages drop where the
    tiles would not fit in shared memory (fp32, SiLU-and-mul's two weight tiles). M > 1 uses
    tensor-core dots, tiles >= 16 wide.

    whole_row (the peeled PDL launch, 16-bit weights, slices up to WHOLE_ROW_MAX_BYTES): one tile spans K,
    so a program's whole weight slice loads before the PDL wait instead of only its first 1024 inputs
    (Qwen3-0.6B's o_proj and down_proj would otherwise load their later tiles after it; ~9% faster batch-1
    graph on the H200). Single-row launch shapes come from B1_CHAIN_SHAPES for the peeled launches.

    max_shared: the device's bytes of shared memory a program may use (_common.max_shared_mem); the stages and
    BLOCK_K tuned on the H200 are cut to fit a smaller card (the budgets below stay 7 KB under it).
    """
    override = (ROWS_SHAPES.get((N, K)) if 1 < M <= PLAIN_MAX_ROWS
                else WIDE_ROWS_SHAPES.get((N, K)) if PLAIN_MAX_ROWS < M <= MAX_M else None)
    budget = 160 * 1024
    if override is not None:
        # A listed shape's launch; only its stages / BLOCK_K are cut below, against the --wide sweep's bound (for
        # 4-byte weights, whose tiles are twice the bytes the sweep timed).
        bn, bk, nw, ns = override.block_n, override.block_k, override.num_warps, override.num_stages
        budget = 220 * 1024
    elif M == 1:
        bk = min(1024, max(64, next_pow2(K)))
        # SiLU-and-mul streams two weight tiles per step: fewer warps, one more stage (sweep's best).
        bn, nw, ns = ((8 if N >= 8192 else 4), 4, 4) if silu_mul else (8, 8, 3)
        if whole_row:
            bn, nw = B1_CHAIN_SHAPES.get((N, K), (bn, nw))
        if (whole_row and elem_size <= 2 and 1024 < K
                and bn * next_pow2(K) * elem_size * (2 if silu_mul else 1) <= WHOLE_ROW_MAX_BYTES):
            bk = next_pow2(K)
    else:
        # 32-column tiles (64 on the widest shapes), 4 stages without SiLU-and-mul: at 16 rows the sweep's
        # best on the norm-less shapes this path serves (o_proj, down_proj of Qwen3-0.6B and Llama-3.1-8B on
        # the H200), 6-21% faster than 16-column tiles with 3 stages.
        bn = 32
        while bn < 64 and N // (2 * bn) >= 132:
            bn *= 2
        bk, nw, ns = min(256, max(16, next_pow2(K))), 4, (3 if silu_mul else 4)
    budget = min(budget, max_shared - 7 * 1024)
    tile_bytes = max(bn, 16 if M > 1 else bn) * bk * elem_size * (2 if silu_mul else 1)
    if M > 16 or override is not None:  # the input tile [BLOCK_M, BLOCK_K] too (as the --wide sweep counts it)
        tile_bytes += max(16, next_pow2(M)) * bk * elem_size
    while ns > 1 and tile_bytes * ns > budget:
        ns -= 1
    while bk > 64 and tile_bytes * ns > budget:
        bk //= 2
        tile_bytes //= 2
    return GemvConfig(bn, bk, nw, ns)
