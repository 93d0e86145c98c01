"""Triton RMSNorm (+ residual add), and _row_rstd, the row-scale helper other kernels inline."""

from __future__ import annotations

import torch

from gyrfalcon.kernels.common import HAS_TRITON, next_pow2, tl, triton


if HAS_TRITON:

    @triton.jit
    def _row_rstd(x_row, eps, HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr):
        """1 / sqrt(mean(x^2) + eps) of the HIDDEN elements at x_row, fp32 (BLOCK_H elements per load: a
        program of one warp loops rather than holding a whole 4096-wide row)."""
        h = tl.arange(0, BLOCK_H)
        ss = tl.zeros([BLOCK_H], tl.float32)
        for k0 in range(0, HIDDEN, BLOCK_H):
            xv = tl.load(x_row + k0 + h, mask=k0 + h < HIDDEN, other=0.0).to(tl.float32)
            ss += xv * xv
        return 1.0 / tl.sqrt(tl.sum(ss, axis=0) / HIDDEN + eps)

    @triton.jit
    def _rms_norm_kernel(
        x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
        n_rows, n_inner, stride_x0, stride_x1, stride_r0, stride_r1,
        N, eps, w_offset,
        HAS_RES: tl.constexpr, HAS_W: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
    ):
        # A program normalizes ROWS rows (several short rows per program for per-head q/k norm,
        # one for a hidden-size row). Rows are indexed as (row // n_inner, row % n_inner) so a
        # strided [T, H, D] view (e.g. q sliced out of a fused qkv output) needs no copy.
        row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        r0 = row // n_inner
        r1 = row % n_inner
        cols = tl.arange(0, BLOCK)
        mask = (row < n_rows)[:, None] & (cols < N)[None, :]
        x = tl.load(x_ptr + (r0 * stride_x0 + r1 * stride_x1)[:, None] + cols[None, :], mask=mask, other=0.0)
        out_off = row[:, None].to(tl.int64) * N + cols[None, :]
        if HAS_RES:
            r = tl.load(res_ptr + (r0 * stride_r0 + r1 * stride_r1)[:, None] + cols[None, :], mask=mask, other=0.0)
            # Round the sum to the model dtype before normalizing, exactly as the reference does.
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(res_out_ptr + out_off, x, mask=mask)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=1) / N
        y = xf * tl.math.rsqrt(var + eps)[:, None]
        if HAS_W:
            w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
            y = y * (w + w_offset)[None, :]
        tl.store(out_ptr + out_off, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows_view(t: torch.Tensor):
    """Describe t as rows of its last dim: (n_rows, n_inner, stride0, stride1), last dim contiguous."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 1:
        return t, 1, 1, 0, 0
    if t.dim() == 2:
        return t, t.shape[0], 1, t.stride(0), 0
    if t.dim() == 3:
        return t, t.shape[0] * t.shape[1], t.shape[1], t.stride(0), t.stride(1)
    try:
        t2 = t.view(-1, t.shape[-1])
    except RuntimeError:
        t2 = t.reshape(-1, t.shape[-1])
    return t2, t2.shape[0], 1, t2.stride(0), 0


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    weight_offset: float = 0.0,
):
    """Triton RMSNorm; same contract as rms_norm_ref. Outputs are fresh contiguous tensors."""
    shape = x.shape
    N = shape[-1]
    xv, n_rows, n_inner, sx0, sx1 = _rows_view(x)
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    if residual is not None:
        rv, _, _, sr0, sr1 = _rows_view(residual)
        res_out = torch.empty(shape, dtype=x.dtype, device=x.device)
    else:
        rv, sr0, sr1, res_out = xv, 0, 0, out
    if n_rows == 0:
        return out if residual is None else (out, res_out)
    w = weight.contiguous() if weight is not None else xv
    BLOCK = max(16, next_pow2(N))
    # ~2K+ elements per program: short rows (per-head norms) are batched, long rows go one each.
    ROWS = max(1, min(16, 2048 // BLOCK))
    num_warps = min(16, max(1, ROWS * BLOCK // 512))
    _rms_norm_kernel[(triton.cdiv(n_rows, ROWS),)](
        xv, rv, w, out, res_out,
        n_rows, n_inner, sx0, sx1, sr0, sr1,
        N, float(eps), float(weight_offset),
        HAS_RES=residual is not None, HAS_W=weight is not None, ROWS=ROWS, BLOCK=BLOCK,
        num_warps=num_warps,
    )
    return out if residual is None else (out, res_out)


if HAS_TRITON:

    @triton.jit
    def _qk_norm_whole_kernel(x_ptr, qw_ptr, kw_ptr, out_ptr, stride_x, stride_out, QW, KW, VW, eps,
                              BLOCK: tl.constexpr):
        # Grid: (T, 3). Part 0 / 1: RMSNorm of the row's q / k columns with its weight; part 2: the v columns
        # copied, so the result is one contiguous qkv row for the fused prep (no torch.cat launch).
        t = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        start = tl.where(part == 0, 0, tl.where(part == 1, QW, QW + KW))
        n = tl.where(part == 0, QW, tl.where(part == 1, KW, VW))
        cols = tl.arange(0, BLOCK)
        x_row = x_ptr + t * stride_x + start
        o_row = out_ptr + t * stride_out + start
        if part == 2:
            for c0 in range(0, VW, BLOCK):
                m = c0 + cols < VW
                tl.store(o_row + c0 + cols, tl.load(x_row + c0 + cols, mask=m), mask=m)
        else:
            w_ptr = qw_ptr if part == 0 else kw_ptr
            ss = tl.zeros([BLOCK], tl.float32)
            for c0 in range(0, n, BLOCK):
                xv = tl.load(x_row + c0 + cols, mask=c0 + cols < n, other=0.0).to(tl.float32)
                ss += xv * xv
            rstd = tl.math.rsqrt(tl.sum(ss, axis=0) / n + eps)
            for c0 in range(0, n, BLOCK):
                m = c0 + cols < n
                xv = tl.load(x_row + c0 + cols, mask=m, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + c0 + cols, mask=m, other=0.0).to(tl.float32)
                tl.store(o_row + c0 + cols, (xv * rstd * w).to(out_ptr.dtype.element_ty), mask=m)


def qk_norm_whole_triton(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                         eps: float) -> torch.Tensor:
    """qk_norm_whole_ref's contract in one launch (in place of two norm launches and a cat)."""
    T, width = qkv.shape
    qw, kw = q_weight.shape[0], k_weight.shape[0]
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    out = torch.empty(T, width, dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return out
    # 2K-element chunks: a 6144-wide q row (MiniMax-M2) is three loads per pass, kept in registers of 8 warps.
    block = min(2048, max(16, next_pow2(max(qw, kw))))
    _qk_norm_whole_kernel[(T, 3)](qkv, q_weight, k_weight, out, qkv.stride(0), out.stride(0), qw, kw,
                                  width - qw - kw, float(eps), BLOCK=block, num_warps=8 if block >= 1024 else 4)
    return out
