"""Block-scaled FP8 GEMM for linear layers with float8_e4m3fn weights: y [M, N] = x [M, K] @ dequant(W [N, K])^T
with x quantized per token and per 128 columns on the fly (naive.py for the format). `fp8_block_gemm` dispatches:
the Triton kernel for CUDA inputs (unless GYRFALCON_KERNELS=ref), the dequantizing reference otherwise (the CPU
path)."""

from __future__ import annotations

from typing import Tuple

import torch

from gyrfalcon.kernels.common import use_triton
from gyrfalcon.kernels.fp8_gemm.configs import Fp8GemmConfig, default_config
from gyrfalcon.kernels.fp8_gemm.naive import (FP8_DTYPE, FP8_MAX, dequantize_weight, fp8_block_gemm_ref,
                                              fp8_weight_only_ref, quantize_act, quantize_weight_blockwise,
                                              quantize_weight_per_channel)
from gyrfalcon.kernels.fp8_gemm.triton import fp8_block_gemm_triton


def fp8_block_gemm(x: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                   block: Tuple[int, int] = (128, 128)) -> torch.Tensor:
    """x [M, K] bf16 / fp32, w [N, K] float8_e4m3fn, w_scale_inv [ceil(N / 128), ceil(K / 128)] fp32 (or [N, 1]
    with block (1, K)) -> [M, N] in x's dtype."""
    if use_triton(x):
        return fp8_block_gemm_triton(x, w, w_scale_inv, block)
    return fp8_block_gemm_ref(x, w, w_scale_inv, block)


__all__ = ["FP8_DTYPE", "FP8_MAX", "Fp8GemmConfig", "default_config", "dequantize_weight", "fp8_block_gemm",
           "fp8_block_gemm_ref", "fp8_block_gemm_triton", "fp8_weight_only_ref", "quantize_act",
           "quantize_weight_blockwise", "quantize_weight_per_channel"]
