"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k RMSNorm before RoPE) and a
sparse MoE block in the MLP slot: softmax router over all experts, top-k, renormalized when norm_topk_prob.
Layers in mlp_only_layers, or off the decoder_sparse_step grid, keep a dense gated MLP. The checkpoint stores
the experts one by one (`mlp.experts.<e>.{gate,up,down}_proj.weight`); they load into the stacked w13 / w2."""

from __future__ import annotations

from gyrfalcon.layers.decoder import DecoderLayer
from gyrfalcon.layers.mlp import GatedMLP
from gyrfalcon.layers.moe import SOFTMAX, SparseMoE
from gyrfalcon.models.causal_lm import CausalLM
from gyrfalcon.models.llama import STACKED_PARAMS, rotary_attention

QWEN_EXPERT_PARAMS = (("gate_proj", "w13", 0), ("up_proj", "w13", 1), ("down_proj", "w2", None))


def is_sparse_layer(config, layer_idx: int) -> bool:
    """transformers' rule: MoE unless listed in mlp_only_layers or off every decoder_sparse_step-th layer."""
    mlp_only = getattr(config, "mlp_only_layers", None) or []
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return layer_idx not in mlp_only and config.num_experts > 0 and (layer_idx + 1) % step == 0


class Qwen3MoeForCausalLM(CausalLM):
    stacked_params = STACKED_PARAMS
    supports_tensor_parallel = True
    expert_params = QWEN_EXPERT_PARAMS

    def build_layer(self, config, layer_idx: int, max_position: int) -> DecoderLayer:
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"Unsupported hidden_act {act!r}: gyrfalcon's experts are SwiGLU (silu).")
        attn = rotary_attention(config, layer_idx, max_position, qk_norm=True)
        if is_sparse_layer(config, layer_idx):
            mlp = SparseMoE(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                            config.moe_intermediate_size, scoring=SOFTMAX,
                            norm_topk_prob=bool(getattr(config, "norm_topk_prob", False)))
        else:
            mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        return DecoderLayer(config.hidden_size, config.rms_norm_eps, attn, mlp)
