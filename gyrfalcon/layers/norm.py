"""RMSNorm, with the residual add fused into the same kernel."""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import nn

from gyrfalcon.kernels import rms_norm


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * (weight + weight_offset), in fp32.

    weight_offset=1 gives the zero-centred norm of Qwen3-Next (`* (1 + w)`).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, weight_offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.weight_offset = weight_offset
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """x: [..., hidden]. With a residual returns (norm(x + residual), x + residual)."""
        return rms_norm(x, self.weight, self.eps, residual=residual, weight_offset=self.weight_offset)


def fold_norms_enabled() -> bool:
    """Whether a decoder layer's two RMSNorms launch no kernel of their own (the default; GYRFALCON_FOLD_NORMS=0
    turns it off). At load each norm's weight is folded into the GEMM after it (qkv, gate_up: W * w, the norm
    weight then ones); at run time the residual add is done by the GEMM before it (o_proj, down_proj add into
    the residual stream in place) and each row's rstd by the kernel after it (the fused qkv prep / decode
    attention, SiLU-and-mul), from that row of the residual stream: rms_norm(x) W^T = rstd(x) (x (W * w)^T).
    Batches on the fused norm + GEMV path (single rows) keep it, with the folded weights. On the H200 (run 48,
    latency_llama-3.1-8b_b*_fold*-h200-2026-12-01-run48.json, same call): Llama-3.1-8B b64 5.319 / 5.303 ms
    per step folded vs 5.408 / 5.422 (ABBA), b16 4.590 vs 4.752; the throughput row tied (10,192 vs 10,197
    output tok/s). The upper bound (benchmarks/norm_bound.py, run 43) was b64 5.10 / 5.14 vs 5.35 / 5.33."""
    return os.environ.get("GYRFALCON_FOLD_NORMS", "1") != "0"


def fold_norm_into(weight: torch.Tensor, norm: RMSNorm) -> None:
    """weight [N, K] <- weight * (norm.weight + weight_offset) over K, in fp32 and rounded once; the norm's
    weight becomes ones (offset 0 included), so rms_norm(x) @ weight^T is unchanged wherever the norm still
    runs (the fused norm + GEMV of single rows)."""
    g = norm.weight.float() + norm.weight_offset
    weight.data.copy_((weight.data.float() * g[None, :]).to(weight.dtype))
    norm.weight.data.fill_(1.0 - norm.weight_offset)
