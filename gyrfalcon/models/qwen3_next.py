"""Qwen3-Next (Qwen3-Next-80B-A3B): a hybrid of Gated DeltaNet linear attention (layers/gated_deltanet.py) and
gated full attention, with a sparse MoE (softmax top-k router, renormalized; a shared SwiGLU expert behind a
sigmoid gate) in every MLP slot unless mlp_only_layers / decoder_sparse_step keep it dense.

config.layer_types says which layer is which ("linear_attention" / "full_attention"; transformers derives it from
full_attention_interval: layer i is full attention when (i + 1) % interval == 0). Every RMSNorm of the residual
stream (each layer's two, the final one) and the attention's per-head q/k norms are zero-centred:
x * rsqrt(mean(x^2) + eps) * (1 + w). The attention is Qwen3's with a sigmoid output gate per head from q_proj
and RoPE on the first partial_rotary_factor (0.25) of each head. The linear-attention layers keep a state slot
per request (the "state" cache group); the attention layers the paged K/V.

The checkpoint names a GDN layer's block `linear_attn`; here it sits in the decoder layer's attention slot
(`self_attn`), and load_weights maps the name. MTP weights (`mtp.*`) are kept out of the target: the MTP proposer
(spec_decode/mtp_qwen3_next.py) builds its layer with build_mtp_layer and reads those tensors itself.
"""

from __future__ import annotations

from typing import Iterable, Set, Tuple

import torch

from gyrfalcon.layers.decoder import DecoderLayer
from gyrfalcon.layers.gated_deltanet import GatedDeltaNet
from gyrfalcon.layers.mlp import GatedMLP
from gyrfalcon.layers.moe import SOFTMAX, SparseMoE
from gyrfalcon.models.causal_lm import CausalLM
from gyrfalcon.models.llama import STACKED_PARAMS, rotary_attention
from gyrfalcon.models.qwen3_moe import QWEN_EXPERT_PARAMS, is_sparse_layer

LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"


def layer_types_of(config) -> list:
    """Each layer's kind, from config.layer_types or else full_attention_interval (default 4)."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    interval = getattr(config, "full_attention_interval", 4) or 4
    return [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(config.num_hidden_layers)]


class Qwen3NextForCausalLM(CausalLM):
    # The GDN block of the checkpoint's `linear_attn` lives in the attention slot (first: a rename, no shard).
    stacked_params = ((".linear_attn.", ".self_attn.", None),) + STACKED_PARAMS
    expert_params = QWEN_EXPERT_PARAMS
    # Decode steps replay CUDA graphs: the GDN decode kernels find each row's state slot in the graph's static
    # state_slots input (runner/cuda_graph.py; padding rows write a spare slot). Prefill and mixed steps run eagerly:
    # the padded prefill graphs' empty sequences (query length 0) would run the conv and the chunked rule on zero
    # tokens and write their state back (on the CPU the reference ops loop over sequences on the host anyway).
    supports_cuda_graphs = True
    supports_mixed_graphs = False
    # Qwen3.5 (models/qwen3_5.py) ships the GDN input projections flat, in four tensors (layers/gated_deltanet.py).
    flat_gdn_projections = False
    # GDN heads split by key-head group (layers/gated_deltanet.py), the gated attention's heads as Qwen3's, the MoE
    # as Qwen3-MoE's (the shared expert split, its sigmoid gate replicated).
    supports_tensor_parallel = True

    def __init__(self, config, max_position=None) -> None:
        super().__init__(config, max_position)
        self.model.norm.weight_offset = 1.0

    def build_layer(self, config, layer_idx: int, max_position: int) -> DecoderLayer:
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"Unsupported hidden_act {act!r}: Qwen3-Next's MLPs and conv are SiLU.")
        kind = layer_types_of(config)[layer_idx]
        if kind == LINEAR_ATTENTION:
            attn = GatedDeltaNet(config.hidden_size, config.linear_num_key_heads, config.linear_num_value_heads,
                                 config.linear_key_head_dim, config.linear_value_head_dim,
                                 config.linear_conv_kernel_dim, config.rms_norm_eps, layer_idx,
                                 flat_projections=self.flat_gdn_projections)
        elif kind == FULL_ATTENTION:
            attn = rotary_attention(config, layer_idx, max_position, qk_norm=True, output_gate=True,
                                    qk_norm_offset=1.0)
        else:
            raise ValueError(f"Unsupported layer type {kind!r} at layer {layer_idx}: expected {LINEAR_ATTENTION!r} "
                             f"or {FULL_ATTENTION!r}.")
        mlp = self.build_mlp(config, layer_idx)
        layer = DecoderLayer(config.hidden_size, config.rms_norm_eps, attn, mlp)
        # Zero-centred norms; the blocks bind them again, so that each NormLinear plans with the offset (an offset
        # norm is never folded into a weight nor fused into the GEMV).
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight_offset = 1.0
        attn.bind_input_norm(layer.input_layernorm)
        mlp.bind_input_norm(layer.post_attention_layernorm)
        return layer

    mtp_format = "qwen3_next"

    def build_mtp_layer(self, config, cache_idx: int, max_position: int) -> DecoderLayer:
        """The MTP module's decoder layer (`mtp.layers.<i>`): gated full attention caching at cache_idx (RoPE over
        max_position rows: the draft's chained passes reach k - 1 positions past max_model_len) and the MLP slot
        of the target's layers (MoE in Qwen3-Next), with the zero-centred norms."""
        attn = rotary_attention(config, cache_idx, max_position, qk_norm=True, output_gate=True, qk_norm_offset=1.0)
        mlp = self.build_mlp(config, config.num_hidden_layers - 1)
        layer = DecoderLayer(config.hidden_size, config.rms_norm_eps, attn, mlp)
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight_offset = 1.0
        attn.bind_input_norm(layer.input_layernorm)
        mlp.bind_input_norm(layer.post_attention_layernorm)
        return layer

    def build_mlp(self, config, layer_idx: int):
        if is_sparse_layer(config, layer_idx):
            return SparseMoE(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                             config.moe_intermediate_size,
                             shared_intermediate_size=config.shared_expert_intermediate_size, shared_gate=True,
                             scoring=SOFTMAX, norm_topk_prob=bool(getattr(config, "norm_topk_prob", True)))
        return GatedMLP(config.hidden_size, config.intermediate_size)

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Set[str]:
        return super().load_weights((n, t) for n, t in weights if not n.startswith("mtp."))
