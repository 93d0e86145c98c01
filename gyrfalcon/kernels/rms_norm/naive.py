"""Plain-torch RMSNorm (the CPU path and the kernels' oracle); shapes in the package docstring."""

from __future__ import annotations

import torch


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    weight_offset: float = 0.0,
):
    """Plain-torch RMSNorm.

    Without residual: returns x * rsqrt(mean(x^2) + eps) * (weight + weight_offset), shape of x.
    With residual [same shape as x]: returns (normed, new_residual) with new_residual = x + residual
    added in x.dtype (as Hugging Face does in the model dtype) and normed = rms_norm(new_residual).
    weight_offset=1.0 gives the zero-centred `* (1 + w)` norm of Qwen3-Next.
    """
    new_residual = None
    if residual is not None:
        x = x + residual
        new_residual = x
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        out = out * (weight.float() + weight_offset)
    out = out.to(x.dtype)
    return out if residual is None else (out, new_residual)


def row_rstd_ref(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, hidden] -> fp32 [T]: each row's 1 / sqrt(mean(x^2) + eps), the scale RMSNorm applies."""
    xf = x.float()
    return torch.rsqrt(xf.pow(2).mean(-1) + eps)


def apply_row_scale_ref(t: torch.Tensor, row_scale) -> torch.Tensor:
    """Folded norms: t [T, ...] computed from the un-normalized rows x of
    row_scale = (x [T, hidden], eps) with the norm's weight folded into the GEMM, scaled by each row's rstd
    in fp32 and rounded to t's dtype once: rms_norm(x) @ W^T == rstd(x) * (x @ (W * w)^T)."""
    x, eps = row_scale
    shape = (t.shape[0],) + (1,) * (t.dim() - 1)
    return (t.float() * row_rstd_ref(x, eps).view(shape)).to(t.dtype)


def qk_norm_whole_ref(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """MiniMax-M2's q/k norm: qkv [T, q_width + k_width + v_width] (the fused projection's rows, q_width =
    q_weight's, k_width = k_weight's) -> a new [T, same] with one RMSNorm over each row's whole q part and one over
    its whole k part (before any split into heads), v copied unchanged."""
    qw, kw = q_weight.shape[0], k_weight.shape[0]
    q, k, v = qkv[:, :qw], qkv[:, qw:qw + kw], qkv[:, qw + kw:]
    return torch.cat([rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps), v], dim=-1)
