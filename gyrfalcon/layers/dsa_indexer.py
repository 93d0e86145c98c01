"""DeepSeek sparse attention's lightning indexer (DeepSeek-V3.2): which cached tokens each query's MLA attends to.

    q = wq_b(q_resid)                       [T, H_i, D]   (q_resid: MLA's q_a_layernorm(q_a_proj(x)))
    k = LayerNorm(wk(x))                    [T, D]        one key per token, shared by the index heads
    RoPE rotate_half (NOT MLA's interleaved pairs) on the FIRST qk_rope_head_dim dims of q and k
    w = weights_proj(x) * H_i^-0.5          [T, H_i] fp32
    score(t, j) = sum_h w_h * relu(q_h . k_j) * D^-0.5,   j <= position of t
and each query keeps the min(index_topk, position + 1) best keys; MLA masks the rest out of its softmax. The keys
live in their own paged cache next to the layer's MLA latent (cache_spec.SparseMLASpec), written every step before
the scores read them, so decode steps score against every earlier token's key.

While no sequence of a step can be longer than index_topk, every causal key is selected: forward returns None and
MLA runs dense (the same result without the scores). The bound is the block table's capacity (its width x
block_size), not the step's lengths, so the choice also holds over a captured CUDA graph's whole range.
Checkpoint names: `self_attn.indexer.{wq_b,wk,weights_proj}.weight`, `self_attn.indexer.k_norm.{weight,bias}`; wq_b
and wk load into shards of the MLA layer's GEMMs (wq_b beside q_b_proj: both read q_resid; wk beside q_a_proj and
kv_a_proj_with_mqa: all read x), so this module holds the norm, weights_proj and the selection.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from gyrfalcon.cache_spec import IndexerKeySpec
from gyrfalcon.kernels.dsa_indexer import indexer_topk, store_index_keys
from gyrfalcon.kernels.mla_prep import IndexKeyPrep, IndexQueryPrep
from gyrfalcon.kernels.rotary import apply_rotary
from gyrfalcon.layers.rotary import RotaryEmbedding

# transformers (and DeepSeek's reference) build the key norm as LayerNorm(index_head_dim, eps=1e-6), not from the
# config's rms_norm_eps.
INDEXER_NORM_EPS = 1e-6


class IndexerLayerNorm(nn.Module):
    """LayerNorm with weight and bias over the last dim, computed in fp32: x [T, D] -> [T, D] in x.dtype."""

    def __init__(self, dim: int, eps: float = INDEXER_NORM_EPS) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), x.shape[-1:], self.weight.float(), self.bias.float(), self.eps).to(x.dtype)


class FP32Linear(nn.Module):
    """y = float(x) @ W^T with W kept fp32 whatever the model dtype (and never FP8: not a Linear): the index
    weights are summed over heads into scores whose order decides the selection, and transformers keeps this
    projection in fp32 (_keep_in_fp32_modules)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


class LightningIndexer(nn.Module):
    """The indexer of one MLA layer (module docstring); its keys go into the layer's indexer cache."""

    def __init__(self, hidden_size: int, n_heads: int, head_dim: int, rope_dim: int, index_topk: int,
                 rotary: RotaryEmbedding) -> None:
        """rotary: the MLA layer's RoPE table over rope_dim dims (registered there; used here with rotate_half). wq_b
        and wk live in the MLA layer's GEMMs (module docstring): their outputs come in as q_raw / k_raw."""
        super().__init__()
        if rope_dim > head_dim:
            raise ValueError(f"The indexer's RoPE ({rope_dim} dims) does not fit its head ({head_dim} dims).")
        self.n_heads, self.head_dim, self.rope_dim, self.index_topk = n_heads, head_dim, rope_dim, index_topk
        self.k_norm = IndexerLayerNorm(head_dim)
        self.weights_proj = FP32Linear(hidden_size, n_heads)
        # relu(a * s) = s * relu(a) for s > 0: both scalars fold into the per-head weights.
        self.weight_scale = n_heads ** -0.5 * head_dim ** -0.5
        self.__dict__["rotary"] = rotary

    def key_cache_spec(self, cache_dtype: str) -> IndexerKeySpec:
        """Its keys, one row of index_head_dim per token (the MLA layer declares it beside its latent)."""
        return IndexerKeySpec(self.head_dim, cache_dtype)

    def project(self, positions: torch.Tensor, x: torch.Tensor, q_raw: torch.Tensor, k_raw: torch.Tensor):
        """positions [T], x [T, hidden] (the layer's normed input), q_raw [T, H_i * D] (wq_b's output), k_raw [T, D]
        (wk's) -> (q [T, H_i, D] roped, k [T, D] normed and roped, w [T, H_i] fp32 with both scales folded in)."""
        T = x.shape[0]
        q = q_raw.view(T, self.n_heads, self.head_dim)
        k = self.k_norm(k_raw)
        q, k = apply_rotary(q, k[:, None], positions, self.rotary.cos_sin_cache, self.rope_dim, True)
        w = self.weights_proj(x) * self.weight_scale
        return q, k[:, 0], w

    def forward(self, positions: torch.Tensor, x: torch.Tensor, q_raw: torch.Tensor, k_raw: torch.Tensor,
                key_cache: torch.Tensor, fb) -> Optional[torch.Tensor]:
        """The unfused path (GYRFALCON_DISABLE_FUSION=1): writes this step's keys into key_cache [num_blocks,
        block_size, 1, D] -> the selected key positions per query token, int32 [T, index_topk] (-1: none), or None
        when every causal key is selected (module docstring). fb: the step's ForwardBatch."""
        q, k, w = self.project(positions, x, q_raw, k_raw)
        store_index_keys(k, key_cache, fb.slot_mapping)
        return self.select(q, w, key_cache, fb)

    def key_prep(self, k_raw: torch.Tensor, key_cache: torch.Tensor) -> IndexKeyPrep:
        """The fused path's key inputs: k_raw [T, D] (wk's output) and the LayerNorm, for MLA's kv prep launch (which
        norms, ropes and writes them into key_cache)."""
        return IndexKeyPrep(k_raw, self.k_norm.weight, self.k_norm.bias, self.k_norm.eps, key_cache)

    def query_prep(self, x: torch.Tensor, q_raw: torch.Tensor) -> IndexQueryPrep:
        """The fused path's query inputs: q_raw as [T, H_i, D] and weights_proj(x) [T, H_i] fp32 with their scale,
        for MLA's q prep launch (which ropes the queries and scales the weights)."""
        return IndexQueryPrep(q_raw.view(x.shape[0], self.n_heads, self.head_dim), self.weights_proj(x),
                              self.weight_scale)

    def select(self, q: torch.Tensor, w: torch.Tensor, key_cache: torch.Tensor, fb) -> Optional[torch.Tensor]:
        """Roped q [T, H_i, D], scaled w [T, H_i] over the written keys -> forward's selection (or None)."""
        if self.every_key_selected(fb, key_cache):
            return None
        return indexer_topk(q, w, key_cache, fb.block_tables, fb.seq_lens, fb.query_start_loc, self.index_topk)

    def every_key_selected(self, fb, key_cache: torch.Tensor) -> bool:
        """No sequence of the step can hold more than index_topk keys (its block table's capacity)."""
        return fb.block_tables.shape[1] * key_cache.shape[1] <= self.index_topk
