"""MLA's fused preparation (DeepSeek-V3 / V3.2): everything between the attention block's projections and the
attention kernel in two launches, and the V projection after it in one.

kv prep, after fused_qkv_a_proj ([q_a_proj | the indexer's wk | kv_a_proj_with_mqa]), one program per (token, part):
    kv [T, L + R] -> cache row [RMSNorm(latent) * kv_a_layernorm.weight | RoPE(k_rope)] at slot_mapping
    q_a [T, Q]    -> RMSNorm(q_a) * q_a_layernorm.weight [T, Q]      (returned: q_b_proj's and wq_b's input)
    index.k [T, D] -> LayerNorm(k) (weight, bias) + rotate_half RoPE on its first R dims -> index.cache (V3.2)
q prep, after q_b_proj (V3.2: fused_q_b_proj [wq_b | q_b_proj], and weights_proj):
    q [T, H, nope + R] -> q_abs [T, H, L + R] = [q_nope @ W_UK[h] | RoPE(q_rope)]   (mla_attention's query)
    index.q [T, H_i, D] -> rotate_half RoPE on the first R dims; index.w [T, H_i] -> index.w * w_scale (fp32)
V projection, after attention: o_latent [T, H, L] -> o_proj's input [T, H * v], per head o_h @ W_UV[h]^T.
L = kv_lora_rank, R = qk_rope_head_dim (MLA's RoPE: interleaved pairs unless rope_interleave is off; the indexer's
always rotate_half), Q = q_lora_rank, D = index_head_dim; positions int [T]; cos_sin_cache fp32 [max_pos, R];
caches [num_blocks, block_size, 1, width]; slot_mapping int [T] (-1: not written). Inputs may be row-strided views
(the fused GEMM's output split in place). The norms' eps: kv_a / q_a share one (transformers builds both with
1e-6), the indexer's LayerNorm carries its own. The latent and indexer caches are in the model dtype (no FP8 cache).

Launches of an MLA block in a batch-1 bf16 decode step, counted from layers/mla.py and layers/dsa_indexer.py (the
MoE half of the layer not counted; a GEMM is one launch, cuBLAS or gyrfalcon's GEMV):
    fused, V3:   input norm + fused_qkv_a GEMV 1, kv prep 1, q_b_proj 1, q prep 1, MLA decode 1-2 (split-K +
                 reduce), V projection 1, o_proj 1                                                     = 7-8
    fused, V3.2: input norm 1, fused_qkv_a (with wk) 1, weights_proj 2 (its fp32 cast and GEMM), kv prep 1,
                 fused_q_b (with wq_b) 1, q prep 1, MLA decode 1-2, V projection 1, o_proj 1           = 10-11
                 (+ the indexer's scores and top-k, 2+, once a sequence can outgrow index_topk)
    GYRFALCON_DISABLE_FUSION=1 replaces the three launches of this folder by the separate ops: q_a_layernorm,
    kv_a_layernorm, RoPE, the latent store, the absorbed bmm and its cat, the W_UV bmm and its copy (>= 8, more
    where an op copies its strided input), and for V3.2 the indexer key's LayerNorm (fp32 casts), its RoPE, the
    index query's RoPE, the weight scale and the key store (>= 6); the input norm is its own launch there.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from gyrfalcon.kernels.common import use_triton
from gyrfalcon.kernels.mla_prep.naive import (IndexKeyPrep, IndexQueryPrep, mla_kv_prep_ref, mla_q_prep_ref,
                                              mla_v_proj_ref)
from gyrfalcon.kernels.mla_prep.triton import mla_kv_prep_triton, mla_q_prep_triton, mla_v_proj_triton


def mla_kv_prep(kv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, rope_dim: int,
                is_neox: bool, kv_norm_weight: torch.Tensor, eps: float, cache: torch.Tensor,
                slot_mapping: torch.Tensor, q_a: Optional[torch.Tensor] = None,
                q_norm_weight: Optional[torch.Tensor] = None,
                index: Optional[IndexKeyPrep] = None) -> Optional[torch.Tensor]:
    """The kv prep (module docstring): writes the caches in place, returns RMSNorm(q_a) (None without q_a)."""
    fn = mla_kv_prep_triton if use_triton(kv) else mla_kv_prep_ref
    return fn(kv, positions, cos_sin_cache, rope_dim, is_neox, kv_norm_weight, eps, cache, slot_mapping, q_a,
              q_norm_weight, index)


def mla_q_prep(q: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, rope_dim: int, is_neox: bool,
               w_uk: torch.Tensor, index: Optional[IndexQueryPrep] = None
               ) -> Tuple[torch.Tensor, Optional[Tuple[torch.Tensor, torch.Tensor]]]:
    """The q prep (module docstring) -> (q_abs, None or (index q, index w))."""
    fn = mla_q_prep_triton if use_triton(q) else mla_q_prep_ref
    return fn(q, positions, cos_sin_cache, rope_dim, is_neox, w_uk, index)


def mla_v_proj(o_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """The V projection (module docstring): o_latent [T, H, L], w_uv [H, v, L] -> o_proj's input [T, H * v]."""
    fn = mla_v_proj_triton if use_triton(o_latent) else mla_v_proj_ref
    return fn(o_latent, w_uv)


__all__ = ["IndexKeyPrep", "IndexQueryPrep", "mla_kv_prep", "mla_kv_prep_ref", "mla_kv_prep_triton", "mla_q_prep",
           "mla_q_prep_ref", "mla_q_prep_triton", "mla_v_proj", "mla_v_proj_ref", "mla_v_proj_triton"]
