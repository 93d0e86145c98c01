"""Launch shapes of the Gated DeltaNet kernels (data and the rules that pick them from shapes alone).

None of these has been swept on the GPU yet: they are sized so that the state tiles stay in registers at
Qwen3.5-397B's heads (dk = dv = 128) and a batch-1 step still spreads over the H200's 132 SMs.
"""

from __future__ import annotations

from gyrfalcon.kernels.common import cdiv, next_pow2

# Decode step: one program holds a [dk, BV] fp32 state tile (dk = 128, BV = 32: 16 KB, 32 registers a thread at
# 4 warps). A batch-1 step of 64 value heads of 128 is then 256 programs, about two per SM.
DECODE_BLOCK_V = 32
DECODE_MIN_BLOCK_V = 16
DECODE_NUM_WARPS = 4
DECODE_MIN_PROGRAMS = 256


def decode_block_v(B: int, HV: int, dv: int) -> int:
    """Value columns per decode program: DECODE_BLOCK_V, halved (down to DECODE_MIN_BLOCK_V) while the grid
    (B, HV, dv / BV) would have fewer than DECODE_MIN_PROGRAMS programs."""
    bv = min(DECODE_BLOCK_V, next_pow2(dv))
    while bv > DECODE_MIN_BLOCK_V and B * HV * cdiv(dv, bv) < DECODE_MIN_PROGRAMS:
        bv //= 2
    return bv


# Causal conv1d: a program covers CONV_BLOCK_T tokens x CONV_BLOCK_C channels (prefill) or CONV_BLOCK_C channels
# of one sequence (the one-token update, the window write-back).
CONV_BLOCK_T = 16
CONV_BLOCK_C = 128
CONV_UPDATE_BLOCK_C = 256
CONV_NUM_WARPS = 4

# Gated RMSNorm: rows of one head's dv values, GATED_NORM_ROWS rows a program.
GATED_NORM_ROWS = 8
GATED_NORM_NUM_WARPS = 4

# Chunked prefill: one program per (sequence, value head, value tile) walks its sequence 64 tokens at a time with
# the state tile [dk, CHUNK_BLOCK_V] in registers. Compiled for sm_90 at dk = dv = 128 (scripts/compile_check.py's
# harness): 8 warps, 64 columns use 255 registers with ~1.9 KB of spills and ~190 KB of shared memory (more than
# an A100's 163 KB: other cards need a smaller shape); 32 columns double the programs that recompute each chunk's
# (I + A)^-1, 128 halve the grid of a batch-1 prompt (64 heads: 64 programs for 132 SMs).
CHUNK_BLOCK_V = 64
CHUNK_NUM_WARPS = 8
# TF32 tensor-core dots (10-bit mantissas: errors around 1e-3 relative expected in o and the final state, below the
# bf16 rounding of the activations around it). "ieee" fp32 dots compile to FMA loops with 12 KB of stack a thread
# on sm_90; "tf32x3" (three TF32 passes, ~fp32 accuracy) doubles the chunk loop's instructions.
CHUNK_DOT_PRECISION = "tf32"
