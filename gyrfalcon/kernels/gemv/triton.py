"""The Triton GEMV / skinny GEMM: [residual add +] RMSNorm prologue, SiLU-and-mul or residual-add epilogue, one
launch; a peeled first weight tile under PDL."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from gyrfalcon.kernels.common import (HAS_TRITON, gdc_launch_dependents, gdc_wait, interpreting, max_shared_mem,
                                      next_pow2, pdl_launch_kwargs, tl, triton, use_pdl)
from gyrfalcon.kernels.gemv.configs import MAX_M, GemvConfig, default_config, one_pass_norm_b1


if HAS_TRITON:

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
                     HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr, OUT_DTYPE: tl.constexpr):
        """Input tile [BLOCK_M, BLOCK_K]: x (+ residual), normalized (nw: the norm weight's [BLOCK_K] tile,
        fp32, loaded by the caller), in the weight dtype."""
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
        HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr, SILU_MUL: tl.constexpr, UPCAST: tl.constexpr,
        DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        NORM_BLOCK: tl.constexpr, USE_PDL: tl.constexpr, PEEL: tl.constexpr = False,
        ONE_PASS: tl.constexpr = False, ADD_OUT: tl.constexpr = False,
    ):
        # Grid: (cdiv(N, BLOCK_N),). Each program owns BLOCK_N output columns (and, with SILU_MUL, the
        # matching up-projection rows N..2N) and streams their weight rows once over all of K, with K itself as
        # the bound: its divisibility (specialized by Triton) keeps the masked weight loads vectorized.
        # BLOCK_M == 1 reduces with a multiply-and-sum on the CUDA cores (no 16-row padding); BLOCK_M > 1 uses
        # tl.dot.
        pid = tl.program_id(0)
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
            # pipeline; the peeled form was slower without PDL).
            kmask0 = ks < K
            wmask0 = cmask[:, None] & kmask0[None, :]
            w0 = tl.load(w_ptr + cols[:, None] * stride_w + ks[None, :], mask=wmask0, other=0.0)
            if SILU_MUL:
                wu0 = tl.load(w_ptr + (cols[:, None] + N) * stride_w + ks[None, :], mask=wmask0, other=0.0)
            if HAS_NORM:
                nw0 = tl.load(nw_ptr + ks, mask=kmask0, other=0.0).to(tl.float32)
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
                                 pid == 0, HAS_RES)
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
                                  HAS_NORM, HAS_RES, w_ptr.dtype.element_ty)
            acc = _gemv_acc(acc, xk, w0, UPCAST, DOT_PREC, BLOCK_M)
            if SILU_MUL:
                acc_up = _gemv_acc(acc_up, xk, wu0, UPCAST, DOT_PREC, BLOCK_M)
        for k0 in range(K_START, K, BLOCK_K):
            kk = k0 + ks
            kmask = kk < K
            nw = 0.0
            if HAS_NORM:
                nw = tl.load(nw_ptr + kk, mask=kmask, other=0.0).to(tl.float32)
            if ONE_PASS:
                xk, ssk = _gemv_x_tile_one_pass(x_ptr, r_ptr, r_out_ptr, nw, rows, rmask, kk, kmask, stride_x,
                                                stride_r, stride_ro, pid == 0, HAS_RES, w_ptr.dtype.element_ty)
                ss1 += ssk
            else:
                xk = _gemv_x_tile(x_ptr, r_ptr, nw, rows, rmask, kk, kmask, stride_x, stride_r, rstd,
                                  HAS_NORM, HAS_RES, w_ptr.dtype.element_ty)
            wmask = cmask[:, None] & kmask[None, :]
            # Both weight tiles are loaded before either is used, so that their latencies overlap.
            w = tl.load(w_ptr + cols[:, None] * stride_w + kk[None, :], mask=wmask, other=0.0)
            if SILU_MUL:
                wu = tl.load(w_ptr + (cols[:, None] + N) * stride_w + kk[None, :], mask=wmask, other=0.0)
            acc = _gemv_acc(acc, xk, w, UPCAST, DOT_PREC, BLOCK_M)
            if SILU_MUL:
                acc_up = _gemv_acc(acc_up, xk, wu, UPCAST, DOT_PREC, BLOCK_M)
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
    for folded norms). config (or block_n / block_k alone) overrides default_config (tests, benchmark sweeps).
    pdl: launch with programmatic dependent launch (default: use_pdl(x)). peel (default: pdl): load the first
    weight and norm-weight tiles before the input (before the PDL wait). one_pass (default: always for 2+ rows
    with a norm, one_pass_norm_b1() for one): the row scale of the norm applied after the loop instead of a
    first pass over the input (the kernel's ONE_PASS)."""
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
    peel = pdl if peel is None else peel
    cfg = config or default_config(M, N, K, silu_mul, weight.element_size(), whole_row=peel,
                                   max_shared=max_shared_mem(x.device))
    cfg = cfg._replace(block_n=block_n or cfg.block_n, block_k=block_k or cfg.block_k)
    block_m = 1 if M == 1 else max(16, next_pow2(M))
    bn = cfg.block_n if block_m == 1 else max(16, cfg.block_n)
    bk = max(16, cfg.block_k)
    n_tiles = triton.cdiv(N, bn)
    # (ONE_PASS only with a norm: the kernel checks ONE_PASS alone.)
    if one_pass is None:
        one_pass = True if block_m > 1 else one_pass_norm_b1(K, bk)
    one_pass = norm_weight is not None and one_pass
    dummy = x
    _norm_gemv_kernel[(n_tiles,)](
        x, residual if residual is not None else dummy, norm_weight if norm_weight is not None else dummy,
        weight, y, r_out if r_out is not None else dummy,
        M, N, K, x.stride(0), residual.stride(0) if residual is not None else 0, weight.stride(0),
        y.stride(0), r_out.stride(0) if r_out is not None else 0, float(eps),
        HAS_NORM=norm_weight is not None, HAS_RES=residual is not None, SILU_MUL=silu_mul,
        UPCAST=interpreting(), DOT_PREC="ieee" if weight.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk,
        NORM_BLOCK=min(next_pow2(K), 8192) if block_m == 1 else bk, USE_PDL=pdl,
        PEEL=peel, ONE_PASS=bool(one_pass), ADD_OUT=add_to is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl_launch_kwargs(pdl),
    )
    return y, r_out
