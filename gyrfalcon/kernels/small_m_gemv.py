"""Fused linear layers for decode-sized batches (a few rows): RMSNorm (+ residual add) in the
prologue, SiLU-and-mul in the epilogue, one launch.

At batch 1 a decoder layer is bandwidth-bound GEMVs separated by small element-wise kernels, and on
a GPU every launch inside a CUDA graph still costs ~2 us. Folding the norm into the following GEMV
(each program recomputes the row's rstd from x: K elements, cheap next to its weight tile) and the
gated activation into the gate_up GEMV turns a Llama/Qwen3 layer's
norm, qkv, norm, gate_up, silu_and_mul into two kernels.

x: [M, K] (M small: up to MAX_M = 64 rows, one program's tile), weight: [N, K] (nn.Linear layout).
norm_weight: [K] or None; residual: [M, K] or None (added to x before the norm; the sum is also
returned, as the next residual). silu_mul=True: weight is [2 * I, K], gate rows first, and the output
is silu(x W_gate^T) * (x W_up^T): [M, I].
Returns (y, new_residual or None).

The models use it for single-row inputs (GEMV_MAX_ROWS), where it beats cuBLAS, and for the norm-less
o_proj / down_proj of up to 16 rows (PLAIN_MAX_ROWS); see default_config.

Split-K (GemvConfig.split_k > 1, rows > 1): the grid gets a second axis of K slices; each program writes
its fp32 partial [M, BLOCK_N] to a workspace and the last of a column tile's programs to arrive (an
arrival counter, as decode attention's in-kernel merge does) sums them and runs the epilogue. It is for
33-64-row batches, where cuBLAS reaches ~70% of the HBM roofline on Llama-3.1-8B's qkv and o_proj (96 and
128 CTAs, fewer than the H200's 132 SMs; latency_llama-3.1-8b_b64-h200-2026-11-30-run23.json). Measured
and left off (run 30): at 64 rows the sweep's best launch shapes only tie cuBLAS on the norm-less shapes
(o_proj 13.3 vs 12.1 us, down_proj 35.7 vs 37.1) and lose 4x where the RMSNorm is fused (qkv 81 vs 19);
routing o_proj / down_proj of Llama-8B batch 64 here (GYRFALCON_SMALL_M_PLAIN_ROWS=64) made the step
5.542 ms with split-K 1 and 5.875 with 2, vs 5.436 on cuBLAS. No model routes more than 16 rows here by
default; GYRFALCON_SMALL_M_PLAIN_ROWS (up to 64) and GYRFALCON_GEMV_SPLIT_K stay as the experiment's switches.

merged_heads_gemv: the same kernel with its input tiles computed from decode attention's per-split
partials (paged_decode_attention.DecodePartials) instead of read from x, so that a batch-1 decode step's
o_proj also does the attention's split merge and the reduce launch goes. The merged batch-1 graph uses it
(cuda_graph.merged_graph_splits: 2-4 splits, the whole row in one tile under PDL; off, it lost too: run 61,
0.770 vs 0.725 ms a Qwen3-0.6B step). Over the main graph's 16 splits it lost (then
GYRFALCON_MERGE_INTO_O_PROJ=1): on the H200 the Qwen3-0.6B batch-1 graph replayed in 0.753 ms with it vs
0.732 without, run 12 in benchmarks/results/logs/, when each input tile looped over the splits, a chain of L2
round trips; with all splits loaded at once, 1.348 vs 0.693 ms, run 15, slower with PDL than without (1.638
vs 1.326 ms at startup; the cause was not established: each program repeated the merge of every split for each
of its K / 256 input tiles).
Nsight Compute (run 62, one launch at a time) put the merging o_proj at 6.8 us against 4.8 for o_proj on the
reduce kernel's output (3.7 us).
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from gyrfalcon.kernels._common import (H200_MAX_SHARED, HAS_TRITON, gdc_launch_dependents, gdc_wait, interpreting,
                                       max_shared_mem, next_pow2, pdl_launch_kwargs, tl, triton, use_pdl, use_triton)
from gyrfalcon.kernels.activation import silu_and_mul_ref
from gyrfalcon.kernels.rms_norm import rms_norm_ref

MAX_M = 64  # rows one program's tile holds (BLOCK_M: 1, else 16, 32 or 64)


def norm_gemv_ref(x: torch.Tensor, weight: torch.Tensor, norm_weight: Optional[torch.Tensor] = None,
                  residual: Optional[torch.Tensor] = None, eps: float = 1e-6,
                  silu_mul: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The unfused composition: [residual add +] RMSNorm -> linear -> [silu_and_mul]."""
    new_residual = None
    if norm_weight is not None:
        if residual is not None:
            x, new_residual = rms_norm_ref(x, norm_weight, eps, residual=residual)
        else:
            x = rms_norm_ref(x, norm_weight, eps)
    y = F.linear(x, weight)
    if silu_mul:
        y = silu_and_mul_ref(y)
    return y, new_residual


class GemvConfig(NamedTuple):
    """Launch shape: BLOCK_N output columns per program, BLOCK_K inputs per loop step, split_k K slices
    (programs per column tile, summed in-kernel; rows > 1 only)."""
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1


def one_pass_norm_default() -> bool:
    """Whether a launch of 2+ rows with a norm scales by the rows' rstd after its loop (ONE_PASS) instead of
    computing it in a first pass over the input: GYRFALCON_GEMV_ONE_PASS_NORM=0 turns it off. Single rows
    keep the first pass (one load covers the whole row; that path is the tuned batch-1 one)."""
    return os.environ.get("GYRFALCON_GEMV_ONE_PASS_NORM", "1") != "0"


ONE_PASS_B1_MAX_K = 1024  # the widest single row that applies its norm after the dot by default (one_pass_norm_b1)


def one_pass_norm_b1(K: int, block_k: int) -> bool:
    """Whether a single row of K inputs with a norm, in tiles of block_k, scales by rstd after the dot (ONE_PASS)
    instead of a first pass over the row: GYRFALCON_GEMV_ONE_PASS_NORM_B1 "auto" (the default: when one tile
    covers a row of up to ONE_PASS_B1_MAX_K inputs), "1" (always), "0" (never). With the row in one tile the
    row's sum of squares and its dot with the weight (already in registers under PDL) then reduce side by side
    after the wait instead of one after the other: one block-wide reduction fewer on the path after each wait of
    the batch-1 chain (docs/performance.md). H200, run 74, same call ABAB
    (latency_*_b1_op_*-h200-2026-12-02-run74.json):
    Qwen3-0.6B batch 1 (qkv, gate_up: K 1024) 0.687 / 0.685 ms a step against 0.699 / 0.699 without. It lost on
    Llama-3.1-8B (K 4096, its qkv launch at 205 registers a thread): batch 1 4.366 against 4.225 ms (its graph
    without PDL, four 1024-wide tiles), and the PDL graph timed at startup 4.348 against 4.284 (one whole-row
    tile). Rounds x * norm_weight to the weight dtype where the first pass rounds the normed row."""
    env = os.environ.get("GYRFALCON_GEMV_ONE_PASS_NORM_B1", "auto")
    if env == "auto":
        return block_k >= K and K <= ONE_PASS_B1_MAX_K
    return env == "1"


def split_k_default() -> int:
    """GYRFALCON_GEMV_SPLIT_K (default 1: no split) for launches of more than 16 rows (an experiment; up to 16 rows
    a shape's split comes with its launch shape, rows_shape_overrides)."""
    return max(1, int(os.environ.get("GYRFALCON_GEMV_SPLIT_K", "1")))


# Rows up to which the models route a linear layer through this kernel instead of cuBLAS. On the H200
# (benchmarks/small_m_gemv.py; benchmarks/results/small_m_gemv_*-h200-2026-11-30-run*.json) the
# single-row path ran 1.03-3.25x faster than RMSNorm + cuBLAS on Qwen3-0.6B and Llama-3.1-8B shapes,
# except Llama-8B's qkv (0.95x), and a whole Llama-8B decode step 3% faster; the tensor-core path for
# 4-16 rows was slower than cuBLAS on most shapes.
GEMV_MAX_ROWS = 1


# Rows up to which a linear layer without a norm in front (o_proj, down_proj) goes through this kernel: its
# tensor-core path with 32-column tiles and 4 stages beat cuBLAS (+ its split-K reduce) at 16 rows in the
# H200 sweep (small_m_gemv_sweep-h200-2026-11-30-run2.json: Llama-3.1-8B's o_proj 11.98 vs 13.74 us,
# down_proj 32.21 vs 33.11) and in whole batch-16 decode steps (latency_*_b16_plain_rows16-h200-2026-11-30-
# run21.json: Llama-3.1-8B 4.794 vs 4.899 ms, Qwen3-0.6B 1.394 vs 1.418), where the norm-fused shapes lost.
PLAIN_MAX_ROWS = 16


def _env_rows(name: str, default: int) -> int:
    """A row bound from the environment variable `name` (default when unset), within [GEMV_MAX_ROWS, MAX_M]."""
    return min(MAX_M, max(GEMV_MAX_ROWS, int(os.environ.get(name, default))))


def norm_gemv_rows() -> Tuple[int, int]:
    """(qkv, gate_up): rows up to which a decoder layer runs [residual add +] RMSNorm + that projection through
    this kernel (one launch) instead of the RMSNorm kernel and cuBLAS. GEMV_MAX_ROWS (single rows) by default;
    GYRFALCON_NORM_GEMV_ROWS=N (qkv) and GYRFALCON_NORM_GEMV_GATE_UP_ROWS=N (gate_up + SiLU-and-mul) raise
    them, at most MAX_M: the experiment for the one-pass norm (ONE_PASS) at batch 4-64, which lost (H200, run 33:
    Llama-3.1-8B batch 16 at 7.12 ms per step with qkv through it vs 4.79 ms)."""
    return (_env_rows("GYRFALCON_NORM_GEMV_ROWS", GEMV_MAX_ROWS),
            _env_rows("GYRFALCON_NORM_GEMV_GATE_UP_ROWS", GEMV_MAX_ROWS))


def plain_gemm_max_rows() -> int:
    """Rows up to which a norm-less linear layer goes through this kernel instead of cuBLAS:
    PLAIN_MAX_ROWS, or GYRFALCON_SMALL_M_PLAIN_ROWS (1 = only batch 1; at most MAX_M)."""
    return _env_rows("GYRFALCON_SMALL_M_PLAIN_ROWS", PLAIN_MAX_ROWS)


def peel_default() -> bool:
    """Whether a PDL launch peels its first weight tile (loads it before waiting for its input):
    GYRFALCON_GEMV_PEEL=0 turns that off, leaving PDL's early launch alone. The peeled tiles held in
    registers cut occupancy (scripts/compile_check.py on sm_90, registers a thread: Llama-3.1-8B's qkv 208
    with its whole-row tile vs 48 unpeeled, gate_up 128 vs 64), but without them PDL lost its gain: on the
    H200 (latency_*_b1_*peel0-h200-2026-11-30-run25.json, batch-1 steps) PDL without peeling ran Qwen3-0.6B
    at 0.925 ms vs 0.740 with it, Llama-3.1-8B at 4.406 vs 4.204 without PDL. Kept for experiments."""
    return os.environ.get("GYRFALCON_GEMV_PEEL", "1") != "0"


WHOLE_ROW_MAX_BYTES = 64 * 1024  # one program's weight slice in registers: 8 x 4096 bf16 = 64 a thread at 8 warps


# Rows a program and warps of the peeled (PDL) single-row launches of these (N outputs, K inputs), chosen in the
# Qwen3-0.6B batch-1 chain rather than one launch at a time (benchmarks/small_m_gemv.py --gemv-chain-sweep, H200 run
# 76, gemv_chain-h200-2026-12-02-run76.json: each GEMV at 8-11 other shapes against the defaults in the same rounds;
# 28-layer chain 613.1 us a step at the defaults, qkv 4 rows / 2 warps 597.3, down 4 / 8 599.9, o_proj 4 / 4 603.0,
# gate_up 8 units / 2 warps 606.5). All four in the model, same call ABAB (latency_qwen3-0.6b_b1_shapes_*-run76):
# 0.677 / 0.678 ms a step against 0.688 / 0.688. Fewer rows a program (2x the programs) and fewer warps shorten
# what each program does after its PDL wait; in a launch alone (the sweeps default_config comes from) the defaults
# streamed faster.
B1_CHAIN_SHAPES = {(4096, 1024): (4, 2), (1024, 2048): (4, 4), (3072, 1024): (8, 2), (1024, 3072): (4, 8)}


def b1_shape_overrides(whole_row: bool = True) -> dict:
    """Single-row launch shapes that replace default_config's -> {(N, K): (BLOCK_N, warps)} (read only) for
    launches of N outputs (SiLU-and-mul: N units) over K inputs. GYRFALCON_GEMV_B1_SHAPES unset: B1_CHAIN_SHAPES
    for the peeled (whole_row) launches, none for the others; set, "NxK=BLOCK_N,warps;..." for every single-row
    launch ("": none, the shapes before run 76). BLOCK_K and stages follow from them as usual."""
    spec = os.environ.get("GYRFALCON_GEMV_B1_SHAPES")
    if spec is None:
        return B1_CHAIN_SHAPES if whole_row else {}
    out = {}
    for item in filter(None, (t.strip() for t in spec.split(";"))):
        try:
            nk, shape = item.split("=")
            n, k = (int(v) for v in nk.lower().split("x"))
            bn, warps = (int(v) for v in shape.split(","))
        except ValueError:
            raise ValueError(f"GYRFALCON_GEMV_B1_SHAPES: '{item}' is not NxK=BLOCK_N,warps") from None
        if bn < 1 or bn & (bn - 1) or warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"GYRFALCON_GEMV_B1_SHAPES: '{item}': BLOCK_N a power of two, warps 1-16")
        out[n, k] = (bn, warps)
    return out


# Launch shapes of the tensor-core path (2..PLAIN_MAX_ROWS rows) for these (N outputs, K inputs) in place of
# default_config's; a MergedLinear (qkv, gate_up) of a listed shape also leaves cuBLAS for this kernel at those rows.
# Llama-3.1-8B's at 16 rows from the wide sweep (benchmarks/small_m_gemv.py --wide, H200 run 83, L2-cold,
# gemv16_sweep-h200-2026-12-02-run83.json): down_proj 30.54 us at 512-input steps against 31.64 at the default 256
# (cuBLAS 32.25), qkv 15.28 at 64 columns / 6 stages against cuBLAS's 15.81, o_proj 11.48 against 11.65. down_proj
# and qkv together in the model, same call ABAB: Llama-8B b16 4.444 / 4.444 ms a step (steady medians) against
# 4.504 / 4.504 (latency_llama-3.1-8b_b16_g16_*-run83.json); split-K and 8 warps never won.
ROWS_SHAPES: dict = {(4096, 14336): GemvConfig(32, 512, 4, 4), (6144, 4096): GemvConfig(64, 128, 4, 6),
                     (4096, 4096): GemvConfig(32, 512, 4, 4)}


def _parse_rows_shapes(name: str, spec: str) -> dict:
    """{(N, K): GemvConfig} from "NxK=BLOCK_N,BLOCK_K,warps,stages[,split_k];..." (the variable `name`'s value)."""
    out = {}
    for item in filter(None, (t.strip() for t in spec.split(";"))):
        try:
            nk, shape = item.split("=")
            n, k = (int(v) for v in nk.lower().split("x"))
            vals = [int(v) for v in shape.split(",")]
            if len(vals) not in (4, 5):
                raise ValueError
            cfg = GemvConfig(*vals)
        except ValueError:
            raise ValueError(f"{name}: '{item}' is not NxK=BLOCK_N,BLOCK_K,warps,stages[,split_k]") from None
        pow2 = all(v >= 1 and v & (v - 1) == 0 for v in (cfg.block_n, cfg.block_k))
        if not pow2 or cfg.num_warps not in (1, 2, 4, 8, 16) or not 1 <= cfg.num_stages <= 8 or cfg.split_k < 1:
            raise ValueError(f"{name}: '{item}': BLOCK_N / BLOCK_K powers of two, warps 1-16, stages 1-8, split_k >= 1")
        out[n, k] = cfg
    return out


def rows_shape_overrides() -> dict:
    """Launch shapes for 2..PLAIN_MAX_ROWS rows that replace default_config's -> {(N, K): GemvConfig} (read only).
    GYRFALCON_GEMV_ROWS_SHAPES unset: ROWS_SHAPES; set, "NxK=BLOCK_N,BLOCK_K,warps,stages[,split_k];..." ("": none).
    N is the launch's output width (SiLU-and-mul: its units)."""
    spec = os.environ.get("GYRFALCON_GEMV_ROWS_SHAPES")
    return ROWS_SHAPES if spec is None else _parse_rows_shapes("GYRFALCON_GEMV_ROWS_SHAPES", spec)


# Launch shapes for PLAIN_MAX_ROWS + 1..MAX_M rows; a linear layer of a listed (N, K) goes through this kernel up to
# MAX_M rows instead of cuBLAS (GYRFALCON_GEMV_WIDE_ROWS_SHAPES replaces the list; "" empties it). At 64 rows (H200
# run 90, small_m_gemv.py --wide --ms 64, L2-cold, gemv64_sweep-h200-2026-12-02-run90.json) Llama-3.1-8B's down_proj
# took 35.0 us at 32 columns, 256-input steps, 4 warps, 4 stages against cuBLAS's 36.9 plus its split-K reduce (40.8
# at default_config's 3 stages); o_proj 12.7 against 12.2 and qkv 17.7 against 16.2 stayed slower. Run 72 had routed
# o_proj and down_proj of up to 64 rows here at default_config's shapes and lost (Llama-8B b64 5.330 / 5.343 ms
# against 5.095 / 5.099). down_proj alone at run 90's shape, Llama-8B b64, same call ABAB / ABBA: steady 5.163 /
# 5.172 ms a step against 5.183 / 5.179 (run 94), 5.042 / 5.046 against 5.095 / 5.092 (run 106, another card;
# latency_llama-3.1-8b_b64_wrows*-h200-2026-12-03-run9{4,106}.json): the default since run 106.
WIDE_ROWS_SHAPES: dict = {(4096, 14336): GemvConfig(32, 256, 4, 4)}


def wide_rows_shape_overrides() -> dict:
    """Launch shapes for PLAIN_MAX_ROWS + 1..MAX_M rows -> {(N, K): GemvConfig} (read only): WIDE_ROWS_SHAPES
    (Llama-3.1-8B's down_proj), or GYRFALCON_GEMV_WIDE_ROWS_SHAPES="NxK=BLOCK_N,BLOCK_K,warps,stages[,split_k];..."
    ("": none)."""
    spec = os.environ.get("GYRFALCON_GEMV_WIDE_ROWS_SHAPES")
    return WIDE_ROWS_SHAPES if spec is None else _parse_rows_shapes("GYRFALCON_GEMV_WIDE_ROWS_SHAPES", spec)


def linear_gemv_rows(n: int, k: int, merged: bool) -> int:
    """Rows up to which a bias-free linear layer of n outputs over k inputs runs on this kernel instead of cuBLAS:
    MAX_M for a shape with a wide launch shape of its own (wide_rows_shape_overrides); else plain_gemm_max_rows()
    for a norm-less Linear and for a MergedLinear (qkv, gate_up) listed in rows_shape_overrides; else single rows."""
    if (n, k) in wide_rows_shape_overrides():
        return MAX_M
    if not merged or (n, k) in rows_shape_overrides():
        return plain_gemm_max_rows()
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
    (Qwen3-0.6B's o_proj and down_proj would otherwise load their later tiles after it). On the H200
    (latency_qwen3-0.6b_b1_whole_row-h200-2026-11-30-run15.json) the Qwen3-0.6B batch-1 graph replayed
    in 0.634 ms vs 0.693 with 1024-input tiles (step 0.742 vs 0.801 ms). GYRFALCON_GEMV_WHOLE_ROW=0 turns
    it off.

    max_shared: the device's bytes of shared memory a program may use (_common.max_shared_mem); the stages and
    BLOCK_K tuned on the H200 are cut to fit a smaller card (the budgets below stay 7 KB under it).
    """
    override = (rows_shape_overrides().get((N, K)) if 1 < M <= PLAIN_MAX_ROWS
                else wide_rows_shape_overrides().get((N, K)) if PLAIN_MAX_ROWS < M <= MAX_M else None)
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
        bn, nw = b1_shape_overrides(whole_row).get((N, K), (bn, nw))
        if (whole_row and elem_size <= 2 and 1024 < K
                and bn * next_pow2(K) * elem_size * (2 if silu_mul else 1) <= WHOLE_ROW_MAX_BYTES
                and os.environ.get("GYRFALCON_GEMV_WHOLE_ROW", "1") == "1"):
            bk = next_pow2(K)
    else:
        # 32-column tiles (64 on the widest shapes), 4 stages without SiLU-and-mul: at 16 rows the sweep's
        # best on the norm-less shapes this path serves (o_proj, down_proj of Qwen3-0.6B and Llama-3.1-8B,
        # small_m_gemv_sweep-h200-2026-11-30-run2.json), 6-21% faster than 16-column tiles with 3 stages.
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
    split_k = override.split_k if override is not None else split_k_default() if M > 16 else 1
    return GemvConfig(bn, bk, nw, ns, split_k)


if HAS_TRITON:

    @triton.jit
    def _merged_x_tile(pacc_ptr, pml_ptr, kk, kmask, n_active, num_splits,
                       HEAD_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr, OUT_DTYPE: tl.constexpr):
        """Input tile [1, BLOCK_K] of o_proj from decode attention's split partials: for input k (head
        h = k // HEAD_D, dim d), sum_s w_s acc[h, s, d] / sum_s w_s l[h, s], w_s = 2^(m[h, s] - max_s m),
        over the n_active splits; rounded to the activation dtype as the reduce kernel's output is.
        All splits load at once as [BLOCK_S, BLOCK_K] tiles (one round trip through L2; a loop over the
        splits is a chain of them, which made this path slower than the reduce launch on the H200)."""
        sp = tl.arange(0, BLOCK_S)
        m2 = (sp < n_active)[:, None] & kmask[None, :]
        row = (kk // HEAD_D)[None, :] * num_splits + sp[:, None]  # [BLOCK_S, BLOCK_K]
        m = tl.load(pml_ptr + row * 2, mask=m2, other=float("-inf"))
        l = tl.load(pml_ptr + row * 2 + 1, mask=m2, other=0.0)
        acc = tl.load(pacc_ptr + row * BLOCK_DV + (kk % HEAD_D)[None, :], mask=m2, other=0.0)
        m_max = tl.max(m, axis=0)
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # no active split (empty sequence)
        w = tl.where(m2, tl.math.exp2(m - m_max[None, :]), 0.0)
        den = tl.sum(w * l, axis=0)
        x = tl.sum(w * acc, axis=0) / tl.where(den == 0.0, 1.0, den)  # empty sequence: zeros
        return x.to(OUT_DTYPE)[None, :]

    @triton.jit
    def _load_x_res(x_ptr, r_ptr, r_out_ptr, rows, rmask, kk, kmask, stride_x, stride_r, stride_ro, write_res,
                    HAS_RES: tl.constexpr):
        """Input tile [BLOCK_M, BLOCK_K] of x (+ residual: added in fp32, rounded once to the activation
        dtype, as the unfused add does); write_res: this program also stores the new residual's tile."""
        m2 = rmask[:, None] & kmask[None, :]
        xk = tl.load(x_ptr + rows[:, None] * stride_x + kk[None, :], mask=m2, other=0.0)
        if HAS_RES:
            rk = tl.load(r_ptr + rows[:, None] * stride_r + kk[None, :], mask=m2, other=0.0)
            xk = (xk.to(tl.float32) + rk.to(tl.float32)).to(x_ptr.dtype.element_ty)
            if write_res:
                tl.store(r_out_ptr + rows[:, None] * stride_ro + kk[None, :], xk, mask=m2)
        return xk

    @triton.jit
    def _gemv_x_tile(x_ptr, r_ptr, nw, rows, rmask, kk, kmask, stride_x, stride_r, rstd,
                     pacc_ptr, pml_ptr, n_active, num_splits,
                     HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr, OUT_DTYPE: tl.constexpr,
                     MERGE_X: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                     BLOCK_S: tl.constexpr):
        """Input tile [BLOCK_M, BLOCK_K]: x (+ residual), normalized (nw: the norm weight's [BLOCK_K] tile,
        fp32, loaded by the caller), in the weight dtype; with MERGE_X merged from decode attention's split
        partials instead (_merged_x_tile, one row)."""
        if MERGE_X:
            xk = _merged_x_tile(pacc_ptr, pml_ptr, kk, kmask, n_active, num_splits, HEAD_D, BLOCK_DV, BLOCK_S,
                                OUT_DTYPE)
        else:
            xk = _load_x_res(x_ptr, r_ptr, x_ptr, rows, rmask, kk, kmask, stride_x, stride_r, 0, False, HAS_RES)
            if HAS_NORM:
                xk = (xk.to(tl.float32) * rstd[:, None] * nw[None, :]).to(OUT_DTYPE)
        return xk

    @triton.jit
    def _gemv_x_tile_one_pass(x_ptr, r_ptr, r_out_ptr, nw, rows, rmask, kk, kmask, stride_x, stride_r, stride_ro,
                              write_res, HAS_RES: tl.constexpr, OUT_DTYPE: tl.constexpr):
        """ONE_PASS's input tile: (x [+ residual] times the norm weight only, in the weight dtype; the rows'
        sums of squares over this tile, fp32 [BLOCK_M]). The row scale rstd is applied to the accumulators
        after the loop (_apply_rstd). write_res: this program also stores the new residual's tile."""
        xk = _load_x_res(x_ptr, r_ptr, r_out_ptr, rows, rmask, kk, kmask, stride_x, stride_r, stride_ro, write_res,
                         HAS_RES)
        xf = xk.to(tl.float32)
        return (xf * nw[None, :]).to(OUT_DTYPE), tl.sum(xf * xf, axis=1)

    @triton.jit
    def _apply_rstd(acc, acc_up, ss, K, eps):
        """ONE_PASS's end: both accumulators [BLOCK_M, BLOCK_N] times each row's rstd, from its sum of squares."""
        r = 1.0 / tl.sqrt(ss / K + eps)
        return acc * r[:, None], acc_up * r[:, None]

    @triton.jit
    def _gemv_acc(acc, xk, w, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr):
        """acc [BLOCK_M, BLOCK_N] += xk [BLOCK_M, BLOCK_K] @ w [BLOCK_N, BLOCK_K]^T."""
        if BLOCK_M == 1:
            acc += tl.sum(w.to(tl.float32) * xk.to(tl.float32), axis=1)[None, :]
        elif UPCAST:  # the interpreter's dot mishandles 16-bit operands
            acc += tl.dot(xk.to(tl.float32), tl.trans(w.to(tl.float32)))
        else:
            acc += tl.dot(xk.to(w.dtype), tl.trans(w), input_precision=DOT_PREC)
        return acc

    @triton.jit
    def _gemv_epilogue(acc, acc_up, y_ptr, rows, rmask, cols, cmask, stride_y, SILU_MUL: tl.constexpr,
                       ADD_OUT: tl.constexpr = False):
        """[SiLU-and-mul of the gate and up accumulators, then] the store of y. ADD_OUT: y already holds a
        residual; the result is added to it (in fp32, rounded once) in place, as cuBLAS's beta = 1 does. Each
        program reads and writes only its own tile, so in place is safe."""
        if SILU_MUL:
            # Round to the activation dtype first, as the unfused path stores gate_up before the act.
            g = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
            u = acc_up.to(y_ptr.dtype.element_ty).to(tl.float32)
            acc = g / (1.0 + tl.exp(-g)) * u
        ptrs = y_ptr + rows[:, None] * stride_y + cols[None, :]
        omask = rmask[:, None] & cmask[None, :]
        if ADD_OUT:
            acc += tl.load(ptrs, mask=omask, other=0.0).to(tl.float32)
        tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=omask)

    @triton.jit
    def _norm_gemv_kernel(
        x_ptr, r_ptr, nw_ptr, w_ptr, y_ptr, r_out_ptr,
        M, N, K, stride_x, stride_r, stride_w, stride_y, stride_ro, eps,
        pacc_ptr, pml_ptr, sl_ptr, num_splits, ws_ptr, cnt_ptr, k_per_split,
        HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr, SILU_MUL: tl.constexpr, UPCAST: tl.constexpr,
        DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        NORM_BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
        MERGE_X: tl.constexpr = False, HEAD_D: tl.constexpr = 1, BLOCK_DV: tl.constexpr = 1,
        ATT_BLOCK_N: tl.constexpr = 1, MIN_PART: tl.constexpr = 1, PEEL: tl.constexpr = False,
        BLOCK_S: tl.constexpr = 1, SPLIT_K: tl.constexpr = 1, ONE_PASS: tl.constexpr = False,
        ADD_OUT: tl.constexpr = False,
    ):
        # MERGE_X (one row): the input is not x but decode attention's per-split partials (merged_heads_gemv),
        # so the attention's reduce launch is folded into o_proj.
        # Grid: (cdiv(N, BLOCK_N), SPLIT_K). Each program owns BLOCK_N output columns (and, with SILU_MUL,
        # the matching up-projection rows N..2N) and streams their weight rows once, over its K slice
        # [pid_k * k_per_split, +k_per_split) (all of K without split-K). BLOCK_M == 1 reduces with a
        # multiply-and-sum on the CUDA cores (no 16-row padding); BLOCK_M > 1 uses tl.dot.
        pid = tl.program_id(0)
        pid_k = tl.program_id(1)
        if SPLIT_K == 1:
            # All of K, with K itself as the bound: its divisibility (specialized by Triton) keeps the
            # masked weight loads vectorized, which a derived bound would lose.
            k_lo = 0
            k_hi = K
        else:
            k_lo = pid_k * k_per_split
            k_hi = tl.minimum(K, k_lo + k_per_split)
        rows = tl.arange(0, BLOCK_M)
        rmask = rows < M
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        ks = tl.arange(0, BLOCK_K)
        nw0 = 0.0
        if PEEL:
            # (PEEL = USE_PDL by default.) The first weight tile and its norm-weight tile do not depend on
            # the previous kernel: load them while that kernel finishes, then wait for its output (x, the
            # residual). Without PDL the plain loop below does all tiles (the loop's own software
            # pipeline; the peeled form was slower without PDL on the H200, run 6).
            kmask0 = ks < K
            wmask0 = cmask[:, None] & kmask0[None, :]
            w0 = tl.load(w_ptr + cols[:, None] * stride_w + ks[None, :], mask=wmask0, other=0.0)
            if SILU_MUL:
                wu0 = tl.load(w_ptr + (cols[:, None] + N) * stride_w + ks[None, :], mask=wmask0, other=0.0)
            if HAS_NORM:
                nw0 = tl.load(nw_ptr + ks, mask=kmask0, other=0.0).to(tl.float32)
        n_active = 0
        if MERGE_X:
            # The split kernel's own arithmetic: splits that held >= 1 key of the (single) sequence
            # (seq_lens is a step input, not the previous kernel's output: it loads before the wait).
            seq_len = tl.load(sl_ptr)
            part = tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), ATT_BLOCK_N) * ATT_BLOCK_N, MIN_PART)
            n_active = tl.cdiv(seq_len, part)
        if USE_PDL:
            gdc_launch_dependents()
            gdc_wait()
        rstd = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
        # ONE_PASS (set only with HAS_NORM): no pass 1. RMSNorm scales each row by one number, so the loop
        # below runs on x * norm_weight, sums the squares of the x tiles it loads anyway, and scales the
        # accumulators by rstd at the end: the norm costs no extra trip over K (pass 1 is a chain of K / BLOCK_K loads
        # ahead of the first weight tile, which made the fused norm lose to cuBLAS at 4-64 rows).
        ss1 = tl.zeros([BLOCK_M], dtype=tl.float32)
        if HAS_NORM and not ONE_PASS:
            # Pass 1 over the (short) input rows: the sum of squares, and the new residual. NORM_BLOCK
            # covers the whole row when it fits (one round trip instead of a chain of K / BLOCK_K: every
            # program repeats this prologue, so its latency adds to each program's time).
            ss = tl.zeros([BLOCK_M], dtype=tl.float32)
            kn = tl.arange(0, NORM_BLOCK)
            for k0 in range(0, K, NORM_BLOCK):
                kk = k0 + kn
                xk = _load_x_res(x_ptr, r_ptr, r_out_ptr, rows, rmask, kk, kk < K, stride_x, stride_r, stride_ro,
                                 (pid == 0) & (pid_k == 0), HAS_RES)
                xf = xk.to(tl.float32)
                ss += tl.sum(xf * xf, axis=1)
            rstd = 1.0 / tl.sqrt(ss / K + eps)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        K_START: tl.constexpr = BLOCK_K if PEEL else 0
        if PEEL:
            if ONE_PASS:
                xk, ssk = _gemv_x_tile_one_pass(x_ptr, r_ptr, r_out_ptr, nw0, rows, rmask, ks, kmask0, stride_x,
                                                stride_r, stride_ro, pid == 0, HAS_RES, w_ptr.dtype.element_ty)
                ss1 += ssk
            else:
                xk = _gemv_x_tile(x_ptr, r_ptr, nw0, rows, rmask, ks, kmask0, stride_x, stride_r, rstd,
                                  pacc_ptr, pml_ptr, n_active, num_splits, HAS_NORM, HAS_RES, w_ptr.dtype.element_ty,
                                  MERGE_X, HEAD_D, BLOCK_DV, BLOCK_S)
            acc = _gemv_acc(acc, xk, w0, UPCAST, DOT_PREC, BLOCK_M)
            if SILU_MUL:
                acc_up = _gemv_acc(acc_up, xk, wu0, UPCAST, DOT_PREC, BLOCK_M)
        for k0 in range(k_lo + K_START, k_hi, BLOCK_K):
            kk = k0 + ks
            kmask = kk < k_hi
            nw = 0.0
            if HAS_NORM:
                nw = tl.load(nw_ptr + kk, mask=kmask, other=0.0).to(tl.float32)
            if ONE_PASS:
                xk, ssk = _gemv_x_tile_one_pass(x_ptr, r_ptr, r_out_ptr, nw, rows, rmask, kk, kmask, stride_x,
                                                stride_r, stride_ro, pid == 0, HAS_RES, w_ptr.dtype.element_ty)
                ss1 += ssk
            else:
                xk = _gemv_x_tile(x_ptr, r_ptr, nw, rows, rmask, kk, kmask, stride_x, stride_r, rstd,
                                  pacc_ptr, pml_ptr, n_active, num_splits, HAS_NORM, HAS_RES,
                                  w_ptr.dtype.element_ty, MERGE_X, HEAD_D, BLOCK_DV, BLOCK_S)
            wmask = cmask[:, None] & kmask[None, :]
            # Both weight tiles are loaded before either is used, so that their latencies overlap.
            w = tl.load(w_ptr + cols[:, None] * stride_w + kk[None, :], mask=wmask, other=0.0)
            if SILU_MUL:
                wu = tl.load(w_ptr + (cols[:, None] + N) * stride_w + kk[None, :], mask=wmask, other=0.0)
            acc = _gemv_acc(acc, xk, w, UPCAST, DOT_PREC, BLOCK_M)
            if SILU_MUL:
                acc_up = _gemv_acc(acc_up, xk, wu, UPCAST, DOT_PREC, BLOCK_M)
        if SPLIT_K > 1:
            # Partials to the workspace [SPLIT_K, BLOCK_M, n_tiles * BLOCK_N (x2 with SILU_MUL)] fp32; the
            # last program of this column tile to arrive sums them (every thread's stores done before the
            # release atomic; the summing program reads the others' through L2, .cg, after the acquire).
            wcols = tl.num_programs(0) * BLOCK_N * (2 if SILU_MUL else 1)
            wrow = rows[:, None] * wcols + cols[None, :]
            tl.store(ws_ptr + pid_k * BLOCK_M * wcols + wrow, acc)
            if SILU_MUL:
                tl.store(ws_ptr + pid_k * BLOCK_M * wcols + wrow + tl.num_programs(0) * BLOCK_N, acc_up)
            # ONE_PASS: this slice's sums of squares too, after the accumulators: [n_tiles, SPLIT_K, BLOCK_M].
            ss_base = ws_ptr + SPLIT_K * BLOCK_M * wcols + pid * SPLIT_K * BLOCK_M
            if ONE_PASS:
                tl.store(ss_base + pid_k * BLOCK_M + rows, ss1)
            tl.debug_barrier()
            done = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel")
            if done == SPLIT_K - 1:
                tl.atomic_xchg(cnt_ptr + pid, 0)  # ready for the next launch (or graph replay)
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                ss_all = tl.zeros([BLOCK_M], dtype=tl.float32)
                for sk in range(SPLIT_K):
                    acc += tl.load(ws_ptr + sk * BLOCK_M * wcols + wrow, cache_modifier=".cg")
                    if SILU_MUL:
                        acc_up += tl.load(ws_ptr + sk * BLOCK_M * wcols + wrow + tl.num_programs(0) * BLOCK_N,
                                          cache_modifier=".cg")
                    if ONE_PASS:
                        ss_all += tl.load(ss_base + sk * BLOCK_M + rows, cache_modifier=".cg")
                if ONE_PASS:
                    acc, acc_up = _apply_rstd(acc, acc_up, ss_all, K, eps)
                _gemv_epilogue(acc, acc_up, y_ptr, rows, rmask, cols, cmask, stride_y, SILU_MUL, ADD_OUT)
        else:
            if ONE_PASS:
                acc, acc_up = _apply_rstd(acc, acc_up, ss1, K, eps)
            _gemv_epilogue(acc, acc_up, y_ptr, rows, rmask, cols, cmask, stride_y, SILU_MUL, ADD_OUT)


def norm_gemv_triton(x: torch.Tensor, weight: torch.Tensor, norm_weight: Optional[torch.Tensor] = None,
                     residual: Optional[torch.Tensor] = None, eps: float = 1e-6, silu_mul: bool = False,
                     block_n: Optional[int] = None, block_k: Optional[int] = None,
                     config: Optional[GemvConfig] = None,
                     pdl: Optional[bool] = None,
                     peel: Optional[bool] = None,
                     one_pass: Optional[bool] = None,
                     add_to: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Same contract as norm_gemv_ref, for x with at most MAX_M rows; no host sync. add_to [M, N] (no norm,
    no SiLU-and-mul): y is added to it in place and add_to returned as y (a residual add done by the GEMM,
    for folded norms: GYRFALCON_FOLD_NORMS). config (or
    block_n / block_k alone) overrides default_config (tests, benchmark sweeps). pdl: launch with
    programmatic dependent launch (default: use_pdl(x)). peel (default: pdl, unless GYRFALCON_GEMV_PEEL=0):
    load the first weight and norm-weight tiles before the input (before the PDL wait). one_pass (default:
    one_pass_norm_default() for 2+ rows with a norm, one_pass_norm_b1() for one): the row scale of the norm
    applied after the loop instead of a first pass over the input (the kernel's ONE_PASS)."""
    M, K = x.shape
    assert M <= MAX_M, f"norm_gemv handles at most {MAX_M} rows, got {M}"
    assert x.stride(-1) == 1 and weight.stride(-1) == 1 and weight.shape[1] == K
    if residual is not None and norm_weight is None:
        raise ValueError("a residual is added before the norm: pass norm_weight too")
    N = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    if add_to is not None:
        if norm_weight is not None or silu_mul:
            raise ValueError("add_to is for a plain GEMM (no norm, no SiLU-and-mul)")
        assert add_to.shape == (M, N) and add_to.dtype == x.dtype and add_to.stride(-1) == 1
        y = add_to
    else:
        y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    r_out = torch.empty_like(x) if residual is not None else None
    if M == 0:
        return y, r_out
    pdl = use_pdl(x) if pdl is None else pdl
    peel = pdl and peel_default() if peel is None else peel
    cfg = config or default_config(M, N, K, silu_mul, weight.element_size(), whole_row=peel,
                                   max_shared=max_shared_mem(x.device))
    cfg = cfg._replace(block_n=block_n or cfg.block_n, block_k=block_k or cfg.block_k)
    block_m = 1 if M == 1 else max(16, next_pow2(M))
    bn = cfg.block_n if block_m == 1 else max(16, cfg.block_n)
    bk = max(16, cfg.block_k)
    n_tiles = triton.cdiv(N, bn)
    split_k = cfg.split_k if block_m > 1 else 1
    # (ONE_PASS only with a norm: the kernel checks ONE_PASS alone.)
    if one_pass is None:
        one_pass = one_pass_norm_default() if block_m > 1 else one_pass_norm_b1(K, bk)
    one_pass = norm_weight is not None and one_pass
    dummy = x
    ws = cnt = dummy
    k_per_split = K
    if split_k > 1:
        peel = False  # the peeled tile is the first of all of K
        k_per_split = triton.cdiv(triton.cdiv(K, split_k), bk) * bk
        ws = torch.empty(split_k * block_m * n_tiles * bn * (2 if silu_mul else 1)
                         + (n_tiles * split_k * block_m if one_pass else 0), dtype=torch.float32, device=x.device)
        cnt = _split_counters(x.device, n_tiles)
    _norm_gemv_kernel[(n_tiles, split_k)](
        x, residual if residual is not None else dummy, norm_weight if norm_weight is not None else dummy,
        weight, y, r_out if r_out is not None else dummy,
        M, N, K, x.stride(0), residual.stride(0) if residual is not None else 0, weight.stride(0),
        y.stride(0), r_out.stride(0) if r_out is not None else 0, float(eps),
        dummy, dummy, dummy, 1, ws, cnt, k_per_split,
        HAS_NORM=norm_weight is not None, HAS_RES=residual is not None, SILU_MUL=silu_mul,
        UPCAST=interpreting(), DOT_PREC="ieee" if weight.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk,
        NORM_BLOCK=min(next_pow2(K), 8192) if block_m == 1 else bk, USE_PDL=pdl,
        PEEL=peel, SPLIT_K=split_k, ONE_PASS=bool(one_pass), ADD_OUT=add_to is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl_launch_kwargs(pdl),
    )
    return y, r_out


_SPLIT_COUNTERS: dict = {}
_MAX_SPLIT_COUNTERS = 1 << 16  # column tiles of one launch, at most (never reallocated: graphs hold it)


def _split_counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 arrival counters, one per column tile, allocated once per device (the first call of a
    decode graph's size runs eagerly before its capture) and left at zero by every split-K launch."""
    if n > _MAX_SPLIT_COUNTERS:
        raise ValueError(f"split-K launch of {n} column tiles: at most {_MAX_SPLIT_COUNTERS}")
    key = (device.type, device.index)
    if key not in _SPLIT_COUNTERS:
        _SPLIT_COUNTERS[key] = torch.zeros(_MAX_SPLIT_COUNTERS, dtype=torch.int32, device=device)
    return _SPLIT_COUNTERS[key]


def merged_heads_gemv_ref(parts, weight: torch.Tensor) -> torch.Tensor:
    """The unfused composition: decode attention's reduce (merge_partials_ref), then the linear layer."""
    from gyrfalcon.kernels.paged_decode_attention import merge_partials_ref
    return F.linear(merge_partials_ref(parts), weight)


MERGED_TILE_ELEMS = 8192  # an input tile's split partials, [splits, BLOCK_K] fp32: 32 a thread at 8 warps


def merged_config(N: int, K: int, num_splits: int, elem_size: int, pdl: bool) -> GemvConfig:
    """merged_heads_gemv's launch shape: default_config's, with each input tile holding every split's
    partials ([splits, BLOCK_K] fp32 accumulators and their (m, l), per input) capped at MERGED_TILE_ELEMS
    to stay in registers. Under PDL with 2-4 splits that is the whole row (default_config's whole_row): the
    weight slice loads before the wait and the merge runs once per program."""
    cfg = default_config(1, N, K, False, elem_size, whole_row=pdl)
    return cfg._replace(block_k=max(16, min(cfg.block_k, MERGED_TILE_ELEMS // next_pow2(num_splits))))


def merged_heads_gemv_triton(parts, weight: torch.Tensor, config: Optional[GemvConfig] = None,
                             pdl: Optional[bool] = None, peel: Optional[bool] = None) -> torch.Tensor:
    """o_proj of a batch-1 decode step straight from decode attention's split partials
    (paged_decode_attention.DecodePartials of one sequence): y [1, N] = merge(parts) @ weight^T with the
    merge done while loading the input tiles, so the attention's reduce launch disappears."""
    sl = parts.seq_lens
    assert sl.shape[0] == 1, "merged_heads_gemv takes one sequence"
    N, K = weight.shape
    assert K == parts.num_heads * parts.head_dim and weight.stride(-1) == 1
    y = torch.empty(1, N, dtype=parts.dtype, device=weight.device)
    pdl = use_pdl(y) if pdl is None else pdl
    cfg = merged_config(N, K, parts.num_splits, weight.element_size(), pdl) if config is None else config
    _norm_gemv_kernel[(triton.cdiv(N, cfg.block_n),)](
        y, y, y, weight, y, y,
        1, N, K, 0, 0, weight.stride(0), y.stride(0), 0, 0.0,
        parts.pacc, parts.pml, sl, parts.num_splits, y, y, K,
        HAS_NORM=False, HAS_RES=False, SILU_MUL=False, UPCAST=interpreting(),
        DOT_PREC="ieee" if weight.dtype == torch.float32 else "tf32",
        BLOCK_M=1, BLOCK_N=cfg.block_n, BLOCK_K=max(16, cfg.block_k), NORM_BLOCK=16, USE_PDL=pdl,
        PEEL=pdl and peel_default() if peel is None else peel,
        MERGE_X=True, HEAD_D=parts.head_dim, BLOCK_DV=parts.pacc.shape[-1], BLOCK_S=next_pow2(parts.num_splits),
        ATT_BLOCK_N=parts.block_n,
        MIN_PART=parts.min_part, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch_kwargs(pdl),
    )
    return y


def norm_gemv(x: torch.Tensor, weight: torch.Tensor, norm_weight: Optional[torch.Tensor] = None,
              residual: Optional[torch.Tensor] = None, eps: float = 1e-6,
              silu_mul: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """norm_gemv_triton on CUDA inputs of up to MAX_M rows, else the reference."""
    if use_triton(x) and x.shape[0] <= MAX_M:
        return norm_gemv_triton(x, weight, norm_weight, residual, eps, silu_mul)
    return norm_gemv_ref(x, weight, norm_weight, residual, eps, silu_mul)
