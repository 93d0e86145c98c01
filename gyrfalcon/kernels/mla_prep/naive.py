"""The unfused composition of the existing references (RMSNorm, LayerNorm, RoPE, the cache writes, the absorbed
query's bmm): the fused MLA prep kernels' oracle and the CPU path. Shapes in the package docstring."""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from gyrfalcon.kernels.dsa_indexer.naive import store_index_keys_ref
from gyrfalcon.kernels.mla_attention.naive import store_latent_ref
from gyrfalcon.kernels.rms_norm.naive import rms_norm_ref
from gyrfalcon.kernels.rotary.naive import apply_rotary_ref


class IndexKeyPrep(NamedTuple):
    """DeepSeek-V3.2's indexer key inputs of the kv prep: k [T, D] (wk's output), the LayerNorm's weight and bias
    [D] and eps, and the indexer key cache [num_blocks, block_size, 1, D]. Its RoPE is rotate_half on the first
    rope_dim dims whatever MLA's own RoPE style is."""
    k: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor
    eps: float
    cache: torch.Tensor


class IndexQueryPrep(NamedTuple):
    """DeepSeek-V3.2's indexer query inputs of the q prep: q [T, H_i, D] (wq_b's output), w [T, H_i] fp32
    (weights_proj's output) and the scalar w is multiplied by (H_i^-0.5 * D^-0.5)."""
    q: torch.Tensor
    w: torch.Tensor
    w_scale: float


def mla_kv_prep_ref(kv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, rope_dim: int,
                    is_neox: bool, kv_norm_weight: torch.Tensor, eps: float, cache: torch.Tensor,
                    slot_mapping: torch.Tensor, q_a: Optional[torch.Tensor] = None,
                    q_norm_weight: Optional[torch.Tensor] = None,
                    index: Optional[IndexKeyPrep] = None) -> Optional[torch.Tensor]:
    """kv [T, L + R] -> cache rows [RMSNorm(latent) | RoPE(k_rope)] at slot_mapping (slot < 0: skipped); q_a
    [T, Q] -> returns RMSNorm(q_a) [T, Q] (None without q_a); index: the indexer key LayerNorm'd, roped
    (rotate_half) and written into index.cache."""
    L = kv.shape[-1] - rope_dim
    latent = rms_norm_ref(kv[:, :L], kv_norm_weight, eps)
    k_rope, _ = apply_rotary_ref(kv[:, None, L:], None, positions, cos_sin_cache, rope_dim, is_neox)
    store_latent_ref(latent, k_rope[:, 0], cache, slot_mapping)
    if index is not None:
        k = F.layer_norm(index.k.float(), index.k.shape[-1:], index.weight.float(), index.bias.float(),
                         index.eps).to(index.k.dtype)
        k, _ = apply_rotary_ref(k[:, None], None, positions, cos_sin_cache, rope_dim, True)
        store_index_keys_ref(k[:, 0], index.cache, slot_mapping)
    return rms_norm_ref(q_a, q_norm_weight, eps) if q_a is not None else None


def mla_q_prep_ref(q: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, rope_dim: int,
                   is_neox: bool, w_uk: torch.Tensor, index: Optional[IndexQueryPrep] = None
                   ) -> Tuple[torch.Tensor, Optional[Tuple[torch.Tensor, torch.Tensor]]]:
    """q [T, H, nope + R], w_uk [H, nope, L] -> (q_abs [T, H, L + R] = [q_nope @ W_UK | RoPE(q_rope)] in q.dtype,
    None or the indexer's (RoPE'd q [T, H_i, D] (rotate_half on the first rope_dim dims), w * w_scale [T, H_i]
    fp32))."""
    nope = q.shape[-1] - rope_dim
    # [H, T, nope] @ [H, nope, L] -> [T, H, L]
    q_latent = torch.bmm(q[..., :nope].transpose(0, 1), w_uk.to(q.dtype)).transpose(0, 1)
    q_rope, _ = apply_rotary_ref(q[..., nope:], None, positions, cos_sin_cache, rope_dim, is_neox)
    q_abs = torch.cat([q_latent, q_rope], dim=-1)
    if index is None:
        return q_abs, None
    iq, _ = apply_rotary_ref(index.q, None, positions, cos_sin_cache, rope_dim, True)
    return q_abs, (iq, index.w.float() * index.w_scale)


def mla_v_proj_ref(o_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """o_latent [T, H, L] (attention's latent-space output), w_uv [H, v, L] -> [T, H * v] in o_latent.dtype, per
    head o_h @ W_UV[h]^T: o_proj's input."""
    T, H, _ = o_latent.shape
    # [H, T, L] @ [H, L, v] -> [T, H, v]
    o = torch.bmm(o_latent.transpose(0, 1), w_uv.to(o_latent.dtype).transpose(1, 2)).transpose(0, 1)
    return o.reshape(T, H * w_uv.shape[1])
