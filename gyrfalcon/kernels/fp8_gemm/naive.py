"""Plain-torch references of the block-scaled FP8 GEMM, and the weight / activation quantizers.

Format (DeepSeek-V3 / Qwen3-FP8 / MiniMax-M2 checkpoints): a weight W [N, K] is stored as float8_e4m3fn with
`weight_scale_inv` fp32 [ceil(N / bn), ceil(K / bk)] (bn = bk = 128); the real weight is W.float() times its
block's scale (a MULTIPLY, despite the name); edge blocks are partial. Activations are quantized on the fly per
token and per `bk` columns with scale = amax / 448 (e4m3's largest finite value), as DeepSeek's act_quant does.

Per-channel weights (`--quantization fp8` on a bf16 checkpoint) are the same format with block (1, K): one scale
per output row ([N, 1]), and the activation group is then the whole row (one scale per token).
"""

from __future__ import annotations

from typing import Tuple

import torch

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
# amax floor: an all-zero group (CUDA-graph padding rows) gets a tiny scale instead of 0 / 0 (its values stay 0).
AMAX_FLOOR = 1e-10
FP8_DTYPE = torch.float8_e4m3fn


def _pad_to(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, cols - t.shape[1], 0, rows - t.shape[0]))


def quantize_weight_blockwise(w: torch.Tensor, block: Tuple[int, int] = (128, 128)
                              ) -> Tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (any float dtype) -> (fp8 [N, K], scale_inv fp32 [ceil(N / bn), ceil(K / bk)]): each block's
    scale is its amax / 448, so the block's largest magnitude maps to 448. block (1, K): per output channel."""
    N, K = w.shape
    bn, bk = block
    nb, kb = -(-N // bn), -(-K // bk)
    wp = _pad_to(w.float(), nb * bn, kb * bk).view(nb, bn, kb, bk)
    amax = wp.abs().amax(dim=(1, 3)).clamp_min(AMAX_FLOOR)  # [nb, kb]
    scale = amax / FP8_MAX
    q = (wp / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.view(nb * bn, kb * bk)[:N, :K].contiguous()
    return q, scale.contiguous()


def quantize_weight_per_channel(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (fp8 [N, K], scale fp32 [N, 1]): block (1, K)."""
    return quantize_weight_blockwise(w, (1, w.shape[1]))


def dequantize_weight(w: torch.Tensor, scale_inv: torch.Tensor, block: Tuple[int, int] = (128, 128)
                      ) -> torch.Tensor:
    """fp8 w [N, K], scale_inv [ceil(N / bn), ceil(K / bk)] -> fp32 [N, K]."""
    N, K = w.shape
    bn, bk = block
    s = scale_inv.float().repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]
    return w.float() * s


def quantize_act(x: torch.Tensor, group: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], scale fp32 [M, ceil(K / group)]): per token and per `group` columns,
    scale = amax / 448, values x / scale (DeepSeek's act_quant). group >= K: one scale per token."""
    M, K = x.shape
    group = min(group, K)
    kb = -(-K // group)
    xp = _pad_to(x.float(), M, kb * group).view(M, kb, group)
    scale = xp.abs().amax(dim=2).clamp_min(AMAX_FLOOR) / FP8_MAX
    q = (xp / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(M, kb * group)[:, :K], scale


def act_group(block: Tuple[int, int], K: int) -> int:
    """Columns an activation scale covers: the weight's block width (bk), or the whole row for per-channel
    weights (block (1, K))."""
    return K if block[0] == 1 else block[1]


def fp8_block_gemm_ref(x: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                       block: Tuple[int, int] = (128, 128)) -> torch.Tensor:
    """The kernel's oracle: x [M, K] quantized as the kernel does (quantize_act), both sides dequantized, one fp32
    matmul. -> [M, N] in x's dtype. Also the CPU path."""
    K = x.shape[1]
    g = act_group(block, K)
    xq, xs = quantize_act(x, g)
    xd = xq.float() * xs.repeat_interleave(g, 1)[:, :K]
    return (xd @ dequantize_weight(w, w_scale_inv, block).t()).to(x.dtype)


def fp8_weight_only_ref(x: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                        block: Tuple[int, int] = (128, 128)) -> torch.Tensor:
    """The second reference: the dequantized weight against the unquantized activations (what transformers
    computes on a dequantized checkpoint); differs from the kernel by the activation quantization alone."""
    return (x.float() @ dequantize_weight(w, w_scale_inv, block).t()).to(x.dtype)
