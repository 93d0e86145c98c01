"""DeepSeek-V3 (and R1, V3.1): multi-head latent attention (layers/mla.py: the latent paged cache, weight
absorption, YaRN with the mscale softmax factor, interleaved RoPE) in every layer; a dense gated MLP in the first
first_k_dense_replace layers, a sparse MoE after them: sigmoid routing with e_score_correction_bias in DeepSeek's
grouped noaux_tc (n_group groups scored by their top-2 experts, topk_group kept), the chosen experts' unbiased
scores normalized and scaled by routed_scaling_factor, plus n_shared_experts always-on experts (one SwiGLU of
moe_intermediate_size x n_shared_experts, added without a gate).

DeepSeek-V3.2 (DeepseekV32ForCausalLM) is the same model with a lightning indexer in every layer's MLA (DeepSeek
sparse attention, layers/dsa_indexer.py: each query attends over its index_topk best-scored keys) and its key cache
beside the latent.

Checkpoint names as transformers saves them: `mlp.experts.<e>.{gate,up,down}_proj.weight` (stacked into w13 / w2),
`mlp.gate.weight`, `mlp.gate.e_score_correction_bias`, `mlp.shared_experts.{gate,up,down}_proj.weight`,
`self_attn.indexer.*` (V3.2). Multi-token-prediction layers (`model.layers.<num_hidden_layers + i>.*` in the released
checkpoints) are kept out of the target: the MTP proposer (spec_decode/mtp.py) builds its layer with
build_mtp_layer and reads those tensors itself."""

from __future__ import annotations

import re
from typing import Iterable, Iterator, Optional, Set, Tuple

import torch

from gyrfalcon.layers.decoder import DecoderLayer
from gyrfalcon.layers.mla import MultiHeadLatentAttention
from gyrfalcon.layers.mlp import GatedMLP
from gyrfalcon.layers.moe import SIGMOID, SparseMoE
from gyrfalcon.layers.rotary import RotaryEmbedding, rope_parameters_of, yarn_softmax_scale
from gyrfalcon.models.causal_lm import CausalLM
from gyrfalcon.models.qwen3_moe import QWEN_EXPERT_PARAMS

DEEPSEEK_STACKED_PARAMS = (
    (".gate_proj", ".gate_up_proj", 0),
    (".up_proj", ".gate_up_proj", 1),
    # MLA's two projections of the normed input, one GEMM (layers/mla.py)
    (".q_a_proj", ".fused_qkv_a_proj", "q"),
    (".q_proj", ".fused_qkv_a_proj", "q"),
    (".kv_a_proj_with_mqa", ".fused_qkv_a_proj", "kv_a"),
)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class DeepseekV3ForCausalLM(CausalLM):
    stacked_params = DEEPSEEK_STACKED_PARAMS
    expert_params = QWEN_EXPERT_PARAMS
    # MLA heads split (layers/mla.py), the dense MLP and shared expert split, the routed experts split inside each
    # expert or (expert parallelism) whole per rank; the router, the latent cache and V3.2's indexer replicated.
    supports_tensor_parallel = True

    def build_layer(self, config, layer_idx: int, max_position: int) -> DecoderLayer:
        return self._build_layer(config, layer_idx, self._rotary(config, max_position),
                                 self._is_sparse_mlp(config, layer_idx))

    mtp_format = "deepseek"

    def build_mtp_layer(self, config, cache_idx: int, max_position: int) -> DecoderLayer:
        """The decoder layer of an MTP module (MLA, the V3.2 indexer, MoE: the released MTP layers sit past
        first_k_dense_replace), caching at cache_idx; its own RoPE table of max_position rows (the draft's chained
        passes write up to k - 1 positions past max_model_len, beyond the target's shared table)."""
        rope_dim = config.qk_rope_head_dim
        rotary = RotaryEmbedding(rope_dim, rope_dim, max_position, rope_parameters_of(config),
                                 config.max_position_embeddings, is_neox=not getattr(config, "rope_interleave", True))
        return self._build_layer(config, cache_idx, rotary, sparse=bool(getattr(config, "n_routed_experts", 0)))

    def _build_layer(self, config, layer_idx: int, rotary: RotaryEmbedding, sparse: bool) -> DecoderLayer:
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"Unsupported hidden_act {act!r}: gyrfalcon's MLPs and experts are SwiGLU (silu).")
        attn = MultiHeadLatentAttention(
            config.hidden_size, config.num_attention_heads, getattr(config, "q_lora_rank", None),
            config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim, layer_idx,
            rotary, self._softmax_scale(config),
            bias=bool(getattr(config, "attention_bias", False)), index=self._index(config))
        n_experts = getattr(config, "n_routed_experts", None) or 0
        if n_experts and sparse:
            n_shared = getattr(config, "n_shared_experts", None) or 0
            mlp = SparseMoE(config.hidden_size, n_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                            shared_intermediate_size=config.moe_intermediate_size * n_shared,
                            shared_name="shared_experts", scoring=SIGMOID, use_bias=True,
                            norm_topk_prob=bool(getattr(config, "norm_topk_prob", True)),
                            n_group=getattr(config, "n_group", None) or 1,
                            topk_group=getattr(config, "topk_group", None) or 1,
                            routed_scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0) or 1.0),
                            logits_fp32=True)
        else:
            mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        return DecoderLayer(config.hidden_size, config.rms_norm_eps, attn, mlp)

    def _index(self, config) -> Optional[Tuple[int, int, int]]:
        """The lightning indexer's (index_n_heads, index_head_dim, index_topk): none in V3."""
        return None

    @staticmethod
    def _is_sparse_mlp(config, layer_idx: int) -> bool:
        """MoE from layer first_k_dense_replace on (V3.2's config spells it out as mlp_layer_types)."""
        kinds = getattr(config, "mlp_layer_types", None)
        if kinds:
            return kinds[layer_idx] == "sparse"
        return layer_idx >= (getattr(config, "first_k_dense_replace", 0) or 0)

    def _rotary(self, config, max_position: int) -> RotaryEmbedding:
        """One RoPE table shared by every layer (max_position x qk_rope_head_dim fp32: ~40 MiB at 160k positions,
        too much to repeat 61 times). Kept out of this module's registered children: each layer registers it."""
        rotary: Optional[RotaryEmbedding] = self.__dict__.get("_shared_rotary")
        if rotary is None:
            rope_dim = config.qk_rope_head_dim
            interleave = getattr(config, "rope_interleave", True)
            rotary = RotaryEmbedding(rope_dim, rope_dim, max_position, rope_parameters_of(config),
                                     config.max_position_embeddings, is_neox=not interleave)
            self.__dict__["_shared_rotary"] = rotary
        return rotary

    @staticmethod
    def _softmax_scale(config) -> float:
        """(qk_nope + qk_rope)^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2."""
        return yarn_softmax_scale(rope_parameters_of(config),
                                  (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5)

    def _checkpoint_names(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Iterator[Tuple[str, torch.Tensor]]:
        """The checkpoint's tensors without its multi-token-prediction layers."""
        num_layers = self.config.num_hidden_layers
        for name, tensor in weights:
            layer = _LAYER.match(name)
            if layer is not None and int(layer.group(1)) >= num_layers:
                continue
            yield name, tensor

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Set[str]:
        loaded = super().load_weights(self._checkpoint_names(weights))
        for m in self.modules():  # an FP8 kv_b_proj's dequantized copy is stale now (layers/mla.py)
            if isinstance(m, MultiHeadLatentAttention):
                m.forget_absorbed()
        return loaded


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3.2: V3 with DeepSeek sparse attention (module docstring)."""

    # The indexer's wk and wq_b are shards of MLA's GEMMs (layers/mla.py, layers/dsa_indexer.py).
    stacked_params = DEEPSEEK_STACKED_PARAMS + (
        (".indexer.wk.", ".fused_qkv_a_proj.", "wk"),
        (".indexer.wq_b.", ".fused_q_b_proj.", "wq_b"),
        (".q_b_proj.", ".fused_q_b_proj.", "q_b"),
    )

    def _index(self, config) -> Optional[Tuple[int, int, int]]:
        return int(config.index_n_heads), int(config.index_head_dim), int(config.index_topk)
