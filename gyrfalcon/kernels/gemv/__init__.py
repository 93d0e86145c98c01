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

The models use it for single-row inputs (GEMV_MAX_ROWS), where it beats cuBLAS, for the norm-less
o_proj / down_proj of up to 16 rows (PLAIN_MAX_ROWS), and for the (N, K) shapes with a launch shape of their
own (ROWS_SHAPES, WIDE_ROWS_SHAPES); see default_config and linear_gemv_rows.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from gyrfalcon.kernels.common import use_triton
from gyrfalcon.kernels.gemv.configs import (B1_CHAIN_SHAPES, GEMV_MAX_ROWS, MAX_M, PLAIN_MAX_ROWS, ROWS_SHAPES,
                                            WHOLE_ROW_MAX_BYTES, WIDE_ROWS_SHAPES, GemvConfig, default_config,
                                            linear_gemv_rows, norm_gemv_rows, one_pass_norm_b1)
from gyrfalcon.kernels.gemv.naive import norm_gemv_ref
from gyrfalcon.kernels.gemv.triton import norm_gemv_triton


def norm_gemv(x: torch.Tensor, weight: torch.Tensor, norm_weight: Optional[torch.Tensor] = None,
              residual: Optional[torch.Tensor] = None, eps: float = 1e-6,
              silu_mul: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """norm_gemv_triton on CUDA inputs of up to MAX_M rows, else the reference."""
    if use_triton(x) and x.shape[0] <= MAX_M:
        return norm_gemv_triton(x, weight, norm_weight, residual, eps, silu_mul)
    return norm_gemv_ref(x, weight, norm_weight, residual, eps, silu_mul)


__all__ = ["B1_CHAIN_SHAPES", "GEMV_MAX_ROWS", "MAX_M", "PLAIN_MAX_ROWS", "ROWS_SHAPES", "WHOLE_ROW_MAX_BYTES",
           "WIDE_ROWS_SHAPES", "GemvConfig", "default_config", "linear_gemv_rows", "norm_gemv", "norm_gemv_ref",
           "norm_gemv_rows", "norm_gemv_triton", "one_pass_norm_b1"]
