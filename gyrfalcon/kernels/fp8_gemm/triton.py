"""The Triton block-scaled FP8 GEMM: y = act_quant(x) @ W^T with both sides' scales applied per 128-wide K step.

Each program owns a [BLOCK_M, BLOCK_N] output tile and walks K in steps of BLOCK_K = the weight's block width: it
loads the x tile (bf16 / fp32), quantizes it to e4m3 per row over that step (scale = amax / 448: the activation
groups are the weight's K blocks, so one activation scale per row and one weight scale per column cover a step),
runs the fp8 x fp8 dot on the tensor cores (fp32 accumulation), and adds it times x_scale[row] * w_scale[col].
The quantization is recomputed by every N tile (cheap next to the weight tile it meets) instead of a separate
act-quant launch. PER_TOKEN (per-channel weights, block (1, K)): a first pass over the row finds each row's amax,
one scale per token.

Under the interpreter the fp8 cast is emulated in fp32 (its own e4m3 cast does not carry a mantissa overflow into
the exponent: 7.9 becomes 4.0) and the dot runs on fp32 operands (the exact values of the fp8 operands).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from gyrfalcon.kernels.common import HAS_TRITON, cdiv, interpreting, tl, triton
from gyrfalcon.kernels.fp8_gemm.configs import Fp8GemmConfig, default_config
from gyrfalcon.kernels.fp8_gemm.naive import AMAX_FLOOR, FP8_MAX

if HAS_TRITON:

    @triton.jit
    def _round_e4m3(v):
        """v (fp32, |v| <= 448) rounded to the nearest e4m3 value (ties to even), still fp32: the interpreter's
        stand-in for .to(float8e4nv). A step of 2^(e - 3) above e4m3's smallest normal (2^-6), 2^-9 below it;
        adding and subtracting 1.5 * 2^23 steps makes the fp32 add round to a multiple of the step."""
        a = tl.abs(v)
        e = tl.floor(tl.log2(tl.maximum(a, 1e-30)))
        e = tl.maximum(e, -6.0)
        magic = tl.exp2(e - 3.0 + 23.0) * 1.5
        return (v + magic) - magic

    @triton.jit
    def _fp8_gemm_kernel(x_ptr, w_ptr, ws_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                         stride_wsn, stride_wsk, amax_floor, fp8_max,
                         W_BN: tl.constexpr, PER_TOKEN: tl.constexpr, INTERPRET: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < M
        cmask = cols < N
        ks = tl.arange(0, BLOCK_K)
        if PER_TOKEN:
            amax = tl.zeros([BLOCK_M], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + ks
                x = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :],
                            mask=rmask[:, None] & (kk < K)[None, :], other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
            xs_tok = tl.maximum(amax, amax_floor) / fp8_max
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            kmask = kk < K
            x = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :],
                        mask=rmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
            if PER_TOKEN:
                xs = xs_tok
            else:
                xs = tl.maximum(tl.max(tl.abs(x), axis=1), amax_floor) / fp8_max
            xq = tl.minimum(tl.maximum(x / xs[:, None], -fp8_max), fp8_max)
            w = tl.load(w_ptr + cols[:, None] * stride_wn + kk[None, :], mask=cmask[:, None] & kmask[None, :],
                        other=0.0)
            ws = tl.load(ws_ptr + (cols // W_BN) * stride_wsn + (k0 // BLOCK_K) * stride_wsk, mask=cmask,
                         other=0.0)
            if INTERPRET:
                d = tl.dot(_round_e4m3(xq), tl.trans(w.to(tl.float32)))
            else:
                d = tl.dot(xq.to(tl.float8e4nv), tl.trans(w))
            acc += d * xs[:, None] * ws[None, :]
        tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=rmask[:, None] & cmask[None, :])


def fp8_block_gemm_triton(x: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                          block: Tuple[int, int] = (128, 128),
                          config: Optional[Fp8GemmConfig] = None) -> torch.Tensor:
    """x [M, K] bf16 / fp16 / fp32, w [N, K] float8_e4m3fn, w_scale_inv fp32 [ceil(N / bn), ceil(K / bk)] with
    block (bn, bk) = (128, 128) (or any bk >= 16 power of two), or [N, 1] with block (1, K) (per channel) ->
    [M, N] in x's dtype."""
    if not HAS_TRITON:
        raise RuntimeError("fp8_block_gemm_triton needs Triton")
    M, K = x.shape
    N = w.shape[0]
    if w.shape[1] != K:
        raise ValueError(f"x has {K} columns but the weight has {w.shape[1]}")
    bn, bk = block
    per_token = bn == 1
    if per_token:
        if tuple(w_scale_inv.shape) != (N, 1):
            raise ValueError(f"per-channel scales must be [{N}, 1], got {tuple(w_scale_inv.shape)}")
        block_k, stride_wsk = 128, 0
    else:
        exp = (cdiv(N, bn), cdiv(K, bk))
        if tuple(w_scale_inv.shape) != exp:
            raise ValueError(f"block scales must be {list(exp)} for a [{N}, {K}] weight, got "
                             f"{list(w_scale_inv.shape)}")
        if bk < 16 or bk & (bk - 1):
            raise ValueError(f"the weight block's width must be a power of two >= 16, got {bk}")
        block_k, stride_wsk = bk, w_scale_inv.stride(1)
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    cfg = config or default_config(M, N, K)
    interp = interpreting()
    grid = (cdiv(M, cfg.block_m), cdiv(N, cfg.block_n))
    _fp8_gemm_kernel[grid](x, w, w_scale_inv, y, M, N, K, x.stride(0), w.stride(0), y.stride(0),
                           w_scale_inv.stride(0), stride_wsk, AMAX_FLOOR, FP8_MAX,
                           W_BN=bn, PER_TOKEN=per_token, INTERPRET=interp, BLOCK_M=cfg.block_m,
                           BLOCK_N=cfg.block_n, BLOCK_K=block_k,
                           **({} if interp else dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)))
    return y
