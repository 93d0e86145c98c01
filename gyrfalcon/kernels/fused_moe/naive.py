"""Plain-torch reference of the fused mixture-of-experts op: a loop over experts.

x [T, H]; w13 [E, 2I, H] (gate rows first, then up: transformers' fused `experts.gate_up_proj`); w2 [E, H, I];
topk_weights [T, k] float32 (the router's weights of each token's chosen experts); topk_ids [T, k] int (expert
indices, each in 0..E-1). out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(g) * u), (g | u) = w13[e] @ x[t],
e = topk_ids[t, j]. The expert GEMMs run in x's dtype with fp32 accumulation (as a GEMM does), the activation and
the weighted sum in fp32; the result in x's dtype.

Expert parallelism (expert_start): w13 / w2 hold E experts, global ids [expert_start, expert_start + E); topk_ids
stay global and the sum runs over the pairs whose expert is among those (w13[e - expert_start]); the others belong
to another rank and contribute nothing here (their rows are never computed). expert_start 0 with every expert held
is the plain op.

FP8 experts (w13_scale / w2_scale given): w13 / w2 are float8_e4m3fn with block scales (kernels/fp8_gemm's
format, one [ceil(N / bn), ceil(K / bk)] grid per expert): w13_scale fp32 [E, ceil(2I / bn), ceil(H / bk)],
w2_scale fp32 [E, ceil(H / bn), ceil(I / bk)], block = (bn, bk). Each expert GEMM is then fp8_block_gemm_ref:
its input (x rows for gate_up, the SiLU-and-mul rows for down) quantized to e4m3 per token and per bk columns
(scale = amax / 448), the weight dequantized, one fp32 matmul, the result rounded to x's dtype; everything around
the GEMMs rounds exactly as the unquantized op does.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from gyrfalcon.kernels.fp8_gemm.naive import FP8_DTYPE, fp8_block_gemm_ref


def check_fp8_experts(w13: torch.Tensor, w2: torch.Tensor, w13_scale: Optional[torch.Tensor],
                      w2_scale: Optional[torch.Tensor], block: Tuple[int, int]) -> bool:
    """Whether the experts are FP8 (both scales given), after checking the weights' dtype and the scales' shapes
    against the block grid; ValueError on a half-given or misshapen pair."""
    if w13_scale is None and w2_scale is None:
        return False
    if w13_scale is None or w2_scale is None:
        raise ValueError("FP8 experts need both w13_scale and w2_scale.")
    if w13.dtype != FP8_DTYPE or w2.dtype != FP8_DTYPE:
        raise ValueError(f"FP8 experts must be {FP8_DTYPE}, got w13 {w13.dtype} / w2 {w2.dtype}.")
    bn, bk = block
    E, two_i, H = w13.shape
    inter = w2.shape[2]
    for name, s, n, k in (("w13_scale", w13_scale, two_i, H), ("w2_scale", w2_scale, H, inter)):
        want = (E, -(-n // bn), -(-k // bk))
        if tuple(s.shape) != want:
            raise ValueError(f"{name} must be {list(want)} for {block} blocks, got {list(s.shape)}.")
    return True


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, w13_scale: Optional[torch.Tensor] = None,
                  w2_scale: Optional[torch.Tensor] = None, block: Tuple[int, int] = (128, 128),
                  expert_start: int = 0) -> torch.Tensor:
    T, H = x.shape
    E, two_i, _ = w13.shape
    inter = two_i // 2
    fp8 = check_fp8_experts(w13, w2, w13_scale, w2_scale, block)
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1)
    flat_w = topk_weights.reshape(-1).float()
    token_of = torch.arange(T, device=x.device).repeat_interleave(topk_ids.shape[1])
    for g in torch.unique(flat_ids).tolist():
        e = g - expert_start
        if not 0 <= e < E:
            continue  # another rank's expert
        sel = (flat_ids == g).nonzero(as_tuple=True)[0]
        tok = token_of[sel]
        if fp8:
            h = fp8_block_gemm_ref(x[tok], w13[e], w13_scale[e], block).float()
        else:
            h = (x[tok] @ w13[e].t()).float()
        act = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]).to(x.dtype)
        if fp8:
            y = fp8_block_gemm_ref(act, w2[e], w2_scale[e], block).float()
        else:
            y = (act @ w2[e].t()).float()
        out.index_add_(0, tok, y * flat_w[sel, None])
    return out.to(x.dtype)
