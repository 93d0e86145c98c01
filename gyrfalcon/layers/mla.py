"""Multi-head latent attention (DeepSeek-V2 / V3's MLA) as a decoder layer's attention block.

    q      = q_b_proj(RMSNorm(q_a_proj(x)))   (q_proj(x) when q_lora_rank is None)   per head [nope | rope]
    kv     = kv_a_proj_with_mqa(x)            [latent L | k_rope R]; k_rope one head shared by all heads
    (q_a_proj / q_proj and kv_a_proj_with_mqa are one GEMM, fused_qkv_a_proj; V3.2 puts its indexer's wk in it
    and its wq_b beside q_b_proj in fused_q_b_proj)
    latent = kv_a_layernorm(latent)
    kv_b_proj(latent) per head [k_nope | v]   (never materialized here: absorbed, below)

RoPE (YaRN in the real models, interleaved pairs unless rope_interleave is off) rotates q's rope part and k_rope.
The paged cache keeps only [latent | roped k_rope] per token (one shared row of L + R, MLALatentSpec), 576
values instead of 2 x 128 heads x 192 in the real model. Attention runs in the latent space ("weight
absorption"): per head, q_nope . (W_UK latent) = (q_nope W_UK) . latent, and sum_j p_j (W_UV latent_j) =
W_UV (sum_j p_j latent_j), so the query becomes [q_nope W_UK | q_rope] [H, L + R], MQA over the cache rows
gives o [H, L], and W_UV maps it to [H, v_head_dim] before o_proj. Every step (prefill chunks, decode, verify)
writes its rows into the cache first and attends from the cache, causally by position. Prefill steps where it needs
fewer FLOPs (long prompts and chunks) attend in the expanded form instead: the context's latent rows through
kv_b_proj into per-head keys and values (layers/mla_expanded.py, ~3x fewer FLOPs at an 8k prompt; the q prep then
only ropes q_rope).

Between the projections and attention, the default path runs two launches (kernels/mla_prep): the kv prep (both
latent RMSNorms, k_rope's RoPE, the latent row into the cache; V3.2: the indexer key's LayerNorm + RoPE + cache
write) and the q prep (the absorbed query [q_nope W_UK | RoPE(q_rope)]; V3.2: the index query's RoPE and weight
scale); after attention one more applies W_UV straight into o_proj's [T, H * v] input. GYRFALCON_DISABLE_FUSION=1
runs each of those as its own op instead (the baseline `bench latency` compares).

DeepSeek-V3.2 adds a lightning indexer (layers/dsa_indexer.py, child `indexer`, reading q_a_layernorm's output):
the layer's cache is then the pair (latent, indexer keys) (SparseMLASpec), and each query attends only over the
indexer's top-k keys (the attention kernels' `indices`).

Tensor parallelism (docs/parallelism.md): rank r holds query heads [r H / tp, (r + 1) H / tp): q_b_proj (q_proj
without a q LoRA) and kv_b_proj column-parallel by head, o_proj row-parallel (its all-reduce is the block's one
collective). What every head shares is replicated: q_a_proj, kv_a_proj_with_mqa, both latent norms, and so the
latent cache, which every rank writes whole (one shared "head": vLLM keeps it so too). The V3.2 indexer is
replicated (wk, wq_b, weights_proj, k_norm on every rank): each rank scores every index head and picks the same
top-k exactly, with no collective; its heads are few (64) next to MLA's (128) and read only the latent query.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from gyrfalcon import envs
from gyrfalcon.cache_spec import MLALatentSpec, SparseMLASpec
from gyrfalcon.distributed import shard_size, tp_rank
from gyrfalcon.forward_context import get_forward_context
from gyrfalcon.kernels.fp8_gemm.naive import dequantize_weight
from gyrfalcon.kernels.mla_attention import mla_attention, store_latent
from gyrfalcon.kernels.mla_prep import mla_kv_prep, mla_q_prep, mla_v_proj
from gyrfalcon.layers.dsa_indexer import LightningIndexer
from gyrfalcon.layers.linear import ColumnParallelLinear, MergedLinear, RowParallelLinear
from gyrfalcon.layers.mla_expanded import ExpandedPrefillPlan, attend_expanded
from gyrfalcon.layers.norm import RMSNorm
from gyrfalcon.layers.norm_linear import NormLinear, project_out
from gyrfalcon.layers.rotary import RotaryEmbedding

# transformers builds q_a_layernorm and kv_a_layernorm with RMSNorm's default eps, not the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class MultiHeadLatentAttention(nn.Module):
    """x [T, hidden] -> o_proj(MLA(x)) [T, hidden] (module docstring). Parameter names follow the checkpoints."""

    # Prefill steps' form (layers/mla_expanded.py): None picks per step by FLOPs; "absorbed" / "expanded" force one
    # (tests hold both against transformers).
    prefill_form: Optional[str] = None

    def __init__(self, hidden_size: int, num_heads: int, q_lora_rank: Optional[int], kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, layer_idx: int,
                 rotary: RotaryEmbedding, scale: float, bias: bool = False,
                 index: Optional[Tuple[int, int, int]] = None) -> None:
        """rotary: RoPE over qk_rope_head_dim dims; scale: the softmax scale (YaRN's mscale included);
        bias: q_a_proj / q_proj, kv_a_proj_with_mqa and o_proj carry biases (config.attention_bias); index:
        (index_n_heads, index_head_dim, index_topk) of a DeepSeek-V3.2 lightning indexer (needs q_lora_rank), None:
        dense MLA."""
        super().__init__()
        # num_heads: this rank's heads (all of them at world size 1; module docstring)
        self.num_heads = shard_size(num_heads, "num_attention_heads")
        self.q_lora_rank, self.kv_lora_rank = q_lora_rank, kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.layer_idx, self.scale = layer_idx, scale
        self.q_width = self.num_heads * self.qk_head_dim if q_lora_rank is None else q_lora_rank
        if bias and (q_lora_rank is None or index is not None):  # transformers' q_proj / wk have no bias there
            raise ValueError("DeepSeek MLA with attention_bias beside an unbiased projection in the same GEMM (q_proj "
                             "without a q LoRA, or the indexer's wk) is not supported.")
        if index is not None and q_lora_rank is None:
            raise ValueError("DeepSeek sparse attention's indexer reads the q_lora residual: q_lora_rank is required.")
        n_idx, d_idx = (index[0], index[1]) if index is not None else (0, 0)
        # The projections of one input are one GEMM each (the checkpoint's tensors land in their shards; FP8 block
        # scales stack while every shard but the last is whole 128-row blocks: 1536 | 128 | 576 in the release):
        # x -> [q_a (q without a q LoRA) | the indexer's wk | kv_a], q_resid -> [the indexer's wq_b | q_b].
        # Tensor parallel: (full rows, (rows here, slice index)) per shard: q_proj's heads split, the rest replicated.
        q_rows = num_heads * self.qk_head_dim if q_lora_rank is None else q_lora_rank
        shards = {"q": (q_rows, (self.q_width, tp_rank()) if q_lora_rank is None else (q_rows, 0))}
        if index is not None:
            shards["wk"] = (d_idx, (d_idx, 0))
        shards["kv_a"] = (kv_lora_rank + qk_rope_head_dim, (kv_lora_rank + qk_rope_head_dim, 0))
        self.fused_qkv_a_proj = MergedLinear(hidden_size, {k: v[0] for k, v in shards.items()}, bias,
                                             {k: v[1] for k, v in shards.items()})
        if q_lora_rank is not None:
            self.q_a_layernorm = RMSNorm(q_lora_rank, LATENT_NORM_EPS)
            if index is None:
                self.q_b_proj = ColumnParallelLinear(q_lora_rank, num_heads * self.qk_head_dim)
            else:
                self.fused_q_b_proj = MergedLinear(
                    q_lora_rank, {"wq_b": n_idx * d_idx, "q_b": num_heads * self.qk_head_dim}, False,
                    {"wq_b": (n_idx * d_idx, 0), "q_b": (self.num_heads * self.qk_head_dim, tp_rank())})
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim))
        self.o_proj = RowParallelLinear(num_heads * v_head_dim, hidden_size, bias)
        self.rotary_emb = rotary
        # The fused path (kernels/mla_prep: two launches before attention, one after) unless
        # GYRFALCON_DISABLE_FUSION=1 (separate ops).
        self.fused = not envs.get().disable_fusion
        self.norm_in: Optional[NormLinear] = None
        self.indexer: Optional[LightningIndexer] = None
        if index is not None:
            n_heads, head_dim, topk = index
            self.indexer = LightningIndexer(hidden_size, n_heads, head_dim, qk_rope_head_dim, topk, rotary)

    def bind_input_norm(self, norm: RMSNorm) -> None:
        # Without an indexer only fused_qkv_a_proj reads the normed input: single rows take the norm inside its GEMV.
        # The indexer's wk and weights_proj read it too, so there the norm runs as its own kernel.
        self.norm_in = _UnfoldedNormLinear(norm, self.fused_qkv_a_proj if self.indexer is None else None)

    def kv_cache_spec(self, cache_dtype: str):
        """One shared row of kv_lora_rank + qk_rope_head_dim per token, in cache_dtype (a torch dtype's name); with an
        indexer, its keys beside it (SparseMLASpec)."""
        latent = MLALatentSpec(self.kv_lora_rank, self.rope_dim, cache_dtype)
        if self.indexer is None:
            return latent
        return SparseMLASpec(latent, self.indexer.key_cache_spec(cache_dtype))

    def absorbed_weights(self, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's weight [H * (nope + v), L] as per-head views: (W_UK [H, nope, L], W_UV [H, v, L]). An FP8
        weight (block scales) is dequantized to dtype on first use and kept (absorption multiplies it into
        activations, not through the FP8 GEMM): [H * (nope + v), L] in dtype beside the FP8 one, 32 MiB a layer in
        bf16 at the real dims, allocated by the first (memory-profiling) forward. Loading weights drops it
        (forget_absorbed)."""
        w = self.kv_b_proj.weight
        if self.kv_b_proj.quant_block is not None:
            held = self.__dict__.get("_kv_b_dequantized")
            if held is None or held.dtype != dtype:
                held = dequantize_weight(w, self.kv_b_proj.weight_scale_inv, self.kv_b_proj.quant_block).to(dtype)
                self.__dict__["_kv_b_dequantized"] = held  # not registered: no checkpoint name, no state_dict entry
            w = held
        w = w.view(self.num_heads, self.nope_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, :self.nope_dim], w[:, self.nope_dim:]

    def forget_absorbed(self) -> None:
        """Drop the kept dequantized kv_b_proj (the model calls it after loading weights into it)."""
        self.__dict__.pop("_kv_b_dequantized", None)

    def forward(self, positions: torch.Tensor, hidden: Optional[torch.Tensor],
                residual: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
        """positions: [T]; (hidden, residual): the residual stream (layers/norm_linear.py) -> the stream after
        this block."""
        n = self.norm_in(hidden, residual)
        assert n.row_scale is None  # never folded (_UnfoldedNormLinear)
        # x: the normed input [T, hidden] where something besides fused_qkv_a_proj reads it (the indexer), else None
        x, qkv_a = (n.y, self.fused_qkv_a_proj(n.y)) if self.norm_in.linear is None else (None, n.y)
        q_or_a, k_idx, kv = self._split_qkv_a(qkv_a)
        T = qkv_a.shape[0]
        ctx = get_forward_context()
        fb, cache = ctx.batch, ctx.kv_caches[self.layer_idx]
        key_cache = None
        if self.indexer is not None:
            cache, key_cache = cache
        w_uk, w_uv = self.absorbed_weights(qkv_a.dtype)
        prep = self._prep_fused if self.fused else self._prep_unfused
        plan = self._expanded_plan(fb, key_cache)
        # q_abs [T, H, L + R]; in the expanded form (w_uk None: no absorbed query) the roped q_rope [T, H, R]
        q_abs, indices, q = prep(positions, x, q_or_a, k_idx, kv, cache, key_cache, fb,
                                 w_uk if plan is None else None)
        if plan is not None:  # q_nope straight from q_b_proj
            o = attend_expanded(plan, q[..., :self.nope_dim], q_abs, cache, fb, self.kv_b_proj, self.num_heads,
                                self.kv_lora_rank, self.v_head_dim, self.scale)
            return project_out(self.o_proj, o, n)
        o_latent = mla_attention(q_abs, cache, fb.block_tables, fb.seq_lens, fb.query_start_loc, self.scale,
                                 self.kv_lora_rank, fb.is_decode, fb.decode_num_splits, indices)  # [T, H, L]
        if self.fused:  # one launch into o_proj's layout
            o = mla_v_proj(o_latent, w_uv)
        else:  # [H, T, L] @ [H, L, v] -> [T, H, v], then its copy to [T, H * v]
            o = torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1).reshape(T, -1)
        return project_out(self.o_proj, o, n)

    def _expanded_plan(self, fb, key_cache: Optional[torch.Tensor]) -> Optional[ExpandedPrefillPlan]:
        """The step's plan when it attends in the expanded form (layers/mla_expanded.py: eager non-decode steps
        without a sparse selection, where the expanded form needs fewer FLOPs), else None (the absorbed form)."""
        if fb.is_decode or self.prefill_form == "absorbed":
            return None
        if self.indexer is not None and not self.indexer.every_key_selected(fb, key_cache):
            return None  # a sparse selection: the absorbed sparse kernels
        if fb.seq_lens.is_cuda and torch.cuda.is_current_stream_capturing():
            return None  # a captured graph: shapes may not follow the host's lengths
        plan = ExpandedPrefillPlan.for_batch(fb)
        if self.prefill_form != "expanded":
            absorbed, expanded = plan.flops(self.kv_lora_rank, self.nope_dim, self.rope_dim, self.v_head_dim)
            if expanded >= absorbed:
                return None
        return plan

    def _split_qkv_a(self, qkv_a: torch.Tensor):
        """fused_qkv_a_proj's output [T, sum of shards] -> (q_a or q, the indexer's k_idx or None, kv), row views."""
        if self.indexer is None:
            q_or_a, kv = qkv_a.split([self.q_width, self.kv_lora_rank + self.rope_dim], dim=-1)
            return q_or_a, None, kv
        return qkv_a.split([self.q_width, self.indexer.head_dim, self.kv_lora_rank + self.rope_dim], dim=-1)

    def _project_q_b(self, q_resid: torch.Tensor):
        """q_resid [T, q_lora_rank] -> (q [T, H * qk], the indexer's wq_b output [T, H_i * D] or None)."""
        if self.indexer is None:
            return self.q_b_proj(q_resid), None
        q_idx, q = self.fused_q_b_proj(q_resid).split(
            [self.indexer.n_heads * self.indexer.head_dim, self.num_heads * self.qk_head_dim], dim=-1)
        return q, q_idx

    def indexer_projections(self, positions: torch.Tensor, x: torch.Tensor, q_resid: torch.Tensor):
        """The indexer's (q, k, w) (LightningIndexer.project) from the normed input x [T, hidden] and q_resid [T,
        q_lora_rank], through this layer's GEMMs: what tests hold against transformers' indexer."""
        _, k_idx, _ = self._split_qkv_a(self.fused_qkv_a_proj(x))
        return self.indexer.project(positions, x, self._project_q_b(q_resid)[1], k_idx)

    def _prep_fused(self, positions: torch.Tensor, x: Optional[torch.Tensor], q_or_a: torch.Tensor,
                    k_idx: Optional[torch.Tensor], kv: torch.Tensor, cache: torch.Tensor,
                    key_cache: Optional[torch.Tensor], fb, w_uk: Optional[torch.Tensor]):
        """kernels/mla_prep's two launches around q_b_proj: the kv prep (both latent norms, k_rope's RoPE, the latent
        cache write; V3.2: the indexer key's LayerNorm + RoPE + cache write) and the q prep (the absorbed query and
        q_rope's RoPE; V3.2: the index query's RoPE and weight scale) -> (q_abs [T, H, L + R], the indexer's
        selection or None). q_or_a: q_a_proj's output [T, q_lora_rank] (q_proj's [T, H * qk] without a q LoRA),
        kv: [T, L + R] and the indexer's k_idx [T, D]: views of fused_qkv_a_proj's output; x: the normed input (with an
        indexer). Also returns q [T, H, nope + R] as projected (its nope part is the expanded form's query). w_uk None
        (the expanded form): no absorbed query, the roped q_rope [T, H, R] in q_abs's place."""
        T = kv.shape[0]
        rot = self.rotary_emb
        q_a = q_or_a if self.q_lora_rank is not None else None
        index_k = self.indexer.key_prep(k_idx, key_cache) if self.indexer is not None else None
        q_resid = mla_kv_prep(kv, positions, rot.cos_sin_cache, self.rope_dim, rot.is_neox, self.kv_a_layernorm.weight,
                              self.kv_a_layernorm.eps, cache, fb.slot_mapping, q_a,
                              self.q_a_layernorm.weight if q_a is not None else None, index_k)
        q, q_idx = self._project_q_b(q_resid) if q_a is not None else (q_or_a, None)
        q = q.view(T, self.num_heads, self.qk_head_dim)
        if w_uk is None:  # the expanded form (every key selected with an indexer): only q_rope's RoPE
            return rot(positions, q[..., self.nope_dim:], None)[0], None, q
        index_q = None
        if self.indexer is not None and not self.indexer.every_key_selected(fb, key_cache):
            index_q = self.indexer.query_prep(x, q_idx)
        q_abs, iq = mla_q_prep(q, positions, rot.cos_sin_cache,
                               self.rope_dim, rot.is_neox, w_uk, index_q)
        return q_abs, (self.indexer.select(iq[0], iq[1], key_cache, fb) if iq is not None else None), q

    def _prep_unfused(self, positions: torch.Tensor, x: Optional[torch.Tensor], q_or_a: torch.Tensor,
                      k_idx: Optional[torch.Tensor], kv: torch.Tensor, cache: torch.Tensor,
                      key_cache: Optional[torch.Tensor], fb, w_uk: Optional[torch.Tensor]):
        """GYRFALCON_DISABLE_FUSION=1: the same as _prep_fused with every norm, RoPE, bmm and cache write its own
        op (the fused path's baseline)."""
        T, H, L = kv.shape[0], self.num_heads, self.kv_lora_rank
        q_idx = None
        if self.q_lora_rank is None:
            q = q_or_a
        else:
            q, q_idx = self._project_q_b(self.q_a_layernorm(q_or_a))
        q = q.view(T, H, self.qk_head_dim)
        latent = self.kv_a_layernorm(kv[:, :L])
        q_rope, k_rope = self.rotary_emb(positions, q[..., self.nope_dim:], kv[:, None, L:])
        if w_uk is None:  # the expanded form: no absorbed query
            q_abs = q_rope
        else:
            # [H, T, nope] @ [H, nope, L] -> the latent-space query [T, H, L], then its rope part beside it.
            q_latent = torch.bmm(q[..., :self.nope_dim].transpose(0, 1), w_uk).transpose(0, 1)
            q_abs = torch.cat([q_latent, q_rope], dim=-1)  # [T, H, L + R]
        indices = None
        if self.indexer is not None:
            indices = self.indexer(positions, x, q_idx, k_idx, key_cache, fb)
        store_latent(latent, k_rope[:, 0], cache, fb.slot_mapping)
        return q_abs, indices, q


class _UnfoldedNormLinear(NormLinear):
    """MLA's input norm: separate or inside the single-row GEMV, never folded into fused_qkv_a_proj's weight (the
    folded form leaves each row's rstd to the consumers, and the kv prep does not scale its rows by it)."""

    @property
    def foldable(self) -> bool:
        return False
