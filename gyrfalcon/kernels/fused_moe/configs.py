"""The fused-MoE op's launch shapes: a rule from the problem shape, and a table of (pairs bucket, H, I) shapes as
data that overrides it. Chosen from shapes only (no autotuning: it would benchmark inside CUDA-graph capture)."""

from __future__ import annotations

from typing import NamedTuple

from gyrfalcon.kernels.common import next_pow2


class GemmTile(NamedTuple):
    """One grouped GEMM's launch: BLOCK_N output columns and BLOCK_K inputs per loop step of a program."""
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


class MoeConfig(NamedTuple):
    """block_m: rows of a sorted tile (each expert's pairs are padded to a multiple of it; one value for both
    GEMMs, which share the sorted order); up: the gate_up GEMM's tile (N = I, K = H); down: the down GEMM's
    (N = H, K = I)."""
    block_m: int
    up: GemmTile
    down: GemmTile


# (Token, expert) pairs up to which the sort runs as one single-program Triton kernel (a decode batch: 32 tokens at
# k = 8); past it, torch's sort and scans (many launches, but a prefill's GEMMs dwarf them; the single program's
# chunked loop would grow with P).
ALIGN_KERNEL_MAX_PAIRS = 256


# Upper bounds of the (token, expert) pair-count buckets that TUNED is keyed by; past the last, the key is None.
PAIR_BUCKETS = (16, 64, 256, 1024, 4096)


def pairs_bucket(num_pairs: int):
    """The TUNED key's first part: the smallest bucket bound >= num_pairs (T * k), or None past the last."""
    for b in PAIR_BUCKETS:
        if num_pairs <= b:
            return b
    return None


# {(pairs bucket, H, I): MoeConfig} tuned shapes (H200, bf16) in place of default_config's rule. Empty until the
# GPU run of issue 15 sweeps Qwen3-30B-A3B's (H 2048, I 768) and MiniMax-M2's (H 3072, I 1536) shapes.
TUNED: dict = {}


def default_config(num_pairs: int, num_experts: int, H: int, I: int, elem_size: int = 2) -> MoeConfig:  # noqa: E741
    """A launch shape for num_pairs = T * k (token, expert) pairs over num_experts experts of hidden size H and
    intermediate size I.

    block_m follows the average rows an expert gets (num_pairs / num_experts): a decode batch (1-16 tokens) gives
    each selected expert one or a few rows, so its tiles are 16 rows (tl.dot's least) and the launch is a stream
    over the selected experts' weights, each program keeping long K tiles in flight; a prefill fills 64-row tiles
    and reuses each weight tile across them. BLOCK_N / BLOCK_K shrink to the problem (the interpreter's tests run
    at H, I of 16-64: one tile, one loop step)."""
    bucket = pairs_bucket(num_pairs)
    if (bucket, H, I) in TUNED:
        return TUNED[(bucket, H, I)]
    avg = num_pairs / max(1, num_experts)
    if avg <= 16:
        # 32-column tiles: a batch-1 step of 8 experts then runs 8 x I / 32 gate_up programs (192 at Qwen3-30B-A3B's
        # I = 768) and 8 x H / 32 down programs, enough to keep the H200's 132 SMs streaming (the GEMV's batch-1
        # sweep favoured many narrow programs with long K tiles too). Not yet swept here (issue 15's GPU run).
        bm = 16
        up = GemmTile(32, 128, 4, 4)
        down = GemmTile(32, 128, 4, 4)
    elif avg <= 48:
        bm = 32
        up = GemmTile(64, 64, 4, 4)
        down = GemmTile(64, 64, 4, 4)
    else:
        bm = 64
        up = GemmTile(128, 64, 8, 3)
        down = GemmTile(128, 64, 8, 3)
    if elem_size >= 4:  # fp32 tiles are twice the bytes: halve K so the stages still fit in shared memory
        up = up._replace(block_k=max(16, up.block_k // 2))
        down = down._replace(block_k=max(16, down.block_k // 2))
    return MoeConfig(bm, _fit(up, I, H), _fit(down, H, I))


# {(pairs bucket, H, I, (bn, bk)): MoeConfig} tuned FP8 shapes in place of fp8_config's rule (empty until a GPU sweep).
TUNED_FP8: dict = {}


def fp8_config(num_pairs: int, num_experts: int, H: int, I: int, block=(128, 128),  # noqa: E741
               elem_size: int = 2) -> MoeConfig:
    """A launch shape for FP8 experts with (bn, bk) weight blocks (kernels/fused_moe/triton.py's FP8 mode).

    BLOCK_K is the weight block's width bk: one K step meets one activation scale per row (the activations are
    quantized per row over exactly that step, as fp8_gemm does) and one weight scale row-block. BLOCK_N stays <= bn
    and divides it, so a program's down columns and its gate columns lie in one scale row-block (one scalar scale a
    K step), and so do its up columns (rows I + cols of w13) when BLOCK_N also divides I: always for checkpoint
    experts (I % bn == 0), not for a w13 quantized whole at load with an odd I, where the kernel loads a scale per
    column instead (SCALE_COLS). block_m follows default_config's rule (the same decode / prefill reasoning). A
    128-wide K step of fp32 activations (fp32
    models on a GPU) is 32 KB a 64-row stage: two stages then instead of three."""
    bucket = pairs_bucket(num_pairs)
    bn, bk = int(block[0]), int(block[1])
    if (bucket, H, I, (bn, bk)) in TUNED_FP8:
        return TUNED_FP8[(bucket, H, I, (bn, bk))]
    base = default_config(num_pairs, num_experts, H, I, 2)
    cap = bn & -bn  # the largest power of two dividing bn (bn itself for 128)

    def tile(t: GemmTile, N: int) -> GemmTile:
        # 64 columns, 8 warps, 3 stages at every batch: the H200 sweep (benchmarks/moe_sweep.py) found it the
        # fastest FP8 tile at both real shapes from 1 to 256 tokens (5-10% over 32 columns / 4 warps / 4 stages
        # from 16 tokens on; a tie at 1), where the bf16 rule's tiles were already within 1-4% of the best.
        stages = 2 if elem_size >= 4 and base.block_m >= 64 else 3
        return GemmTile(max(16, min(64, cap, next_pow2(N))), bk, 8, stages)

    return MoeConfig(base.block_m, tile(base.up, I), tile(base.down, H))


def _fit(t: GemmTile, N: int, K: int) -> GemmTile:
    """t with BLOCK_N / BLOCK_K cut to the problem's N / K (powers of two, >= 16: tl.dot's least)."""
    return t._replace(block_n=min(t.block_n, max(16, next_pow2(N))), block_k=min(t.block_k, max(16, next_pow2(K))))
