"""Llama (2 / 3 / 3.1) and the dense families built the same way: rotary self-attention and a gated MLP in
each decoder layer. Hugging Face's checkpoint layout: q/k/v and gate/up are separate tensors there, fused here."""

from __future__ import annotations

from gyrfalcon.layers.decoder import DecoderLayer
from gyrfalcon.layers.mlp import GatedMLP
from gyrfalcon.layers.rotary import RotaryEmbedding, rope_parameters_of
from gyrfalcon.layers.self_attention import RotarySelfAttention
from gyrfalcon.models.causal_lm import CausalLM

# checkpoint name piece -> (fused parameter name piece, shard id)
STACKED_PARAMS = (
    (".q_proj", ".qkv_proj", "q"),
    (".k_proj", ".qkv_proj", "k"),
    (".v_proj", ".qkv_proj", "v"),
    (".gate_proj", ".gate_up_proj", 0),
    (".up_proj", ".gate_up_proj", 1),
)


def rotary_attention(config, layer_idx: int, max_position: int, qk_norm: bool,
                     qk_norm_whole: bool = False, output_gate: bool = False,
                     qk_norm_offset: float = 0.0) -> RotarySelfAttention:
    """The rotary attention block of `config`: q/k RMSNorm before RoPE when qk_norm (per head, Qwen3; over the
    whole projections when qk_norm_whole, MiniMax-M2; with weight (qk_norm_offset + w)); RoPE over
    config.rotary_dim dims when the config names them, else head_dim x partial_rotary_factor; output_gate: a
    sigmoid gate per head from q_proj (Qwen3-Next)."""
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    params = rope_parameters_of(config)
    rotary_dim = getattr(config, "rotary_dim", None)
    if rotary_dim is None:
        partial = float(params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0) or 1.0))
        rotary_dim = head_dim * partial
    rotary = RotaryEmbedding(head_dim, int(rotary_dim), max_position, params, config.max_position_embeddings)
    attention_bias = bool(getattr(config, "attention_bias", False))
    return RotarySelfAttention(
        config.hidden_size, num_heads, getattr(config, "num_key_value_heads", None) or num_heads, head_dim,
        layer_idx, rotary, qk_norm_eps=config.rms_norm_eps if qk_norm else None, qkv_bias=attention_bias,
        o_proj_bias=attention_bias and bool(getattr(config, "o_proj_bias", False)), qk_norm_whole=qk_norm_whole,
        output_gate=output_gate, qk_norm_offset=qk_norm_offset)


class LlamaForCausalLM(CausalLM):
    stacked_params = STACKED_PARAMS
    supports_tensor_parallel = True
    qk_norm = False  # per-head RMSNorm of q and k before RoPE (Qwen3)

    def build_layer(self, config, layer_idx: int, max_position: int) -> DecoderLayer:
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"Unsupported hidden_act {act!r}: gyrfalcon's Llama MLP is SwiGLU (silu).")
        attn = rotary_attention(config, layer_idx, max_position, self.qk_norm)
        mlp = GatedMLP(config.hidden_size, config.intermediate_size, bool(getattr(config, "mlp_bias", False)))
        return DecoderLayer(config.hidden_size, config.rms_norm_eps, attn, mlp)
