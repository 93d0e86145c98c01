"""Plain-torch reference of the fused mixture-of-experts op: a loop over experts.

x [T, H]; w13 [E, 2I, H] (gate rows first, then up: transformers' fused `experts.gate_up_proj`); w2 [E, H, I];
topk_weights [T, k] float32 (the router's weights of each token's chosen experts); topk_ids [T, k] int (expert
indices, each in 0..E-1). out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(g) * u), (g | u) = w13[e] @ x[t],
e = topk_ids[t, j]. The expert GEMMs run in x's dtype with fp32 accumulation (as a GEMM does), the activation and
the weighted sum in fp32; the result in x's dtype.
"""

from __future__ import annotations

import torch


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    T, H = x.shape
    E, two_i, _ = w13.shape
    inter = two_i // 2
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1)
    flat_w = topk_weights.reshape(-1).float()
    token_of = torch.arange(T, device=x.device).repeat_interleave(topk_ids.shape[1])
    for e in torch.unique(flat_ids).tolist():
        sel = (flat_ids == e).nonzero(as_tuple=True)[0]
        tok = token_of[sel]
        h = (x[tok] @ w13[e].t()).float()
        act = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]).to(x.dtype)
        y = (act @ w2[e].t()).float()
        out.index_add_(0, tok, y * flat_w[sel, None])
    return out.to(x.dtype)
