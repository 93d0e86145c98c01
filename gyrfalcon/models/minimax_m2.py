"""MiniMax-M2 / M2.1 / M2.5: full GQA attention in every layer with a per-layer QK-norm (one RMSNorm over the
whole q projection and one over the whole k projection, before the split into heads) and partial rotary
(rotate_half on the first rotary_dim dims of each head); every MLP slot a sparse MoE with sigmoid routing:
experts chosen by sigmoid(logits) + e_score_correction_bias, weighted by the unbiased scores normalized to 1.

Checkpoint names: `block_sparse_moe.gate.weight` (router), `block_sparse_moe.e_score_correction_bias`,
`block_sparse_moe.experts.<e>.w1/w3/w2.weight` (gate / up / down) -> mlp.gate, mlp.gate.e_score_correction_bias,
mlp.experts.w13 / w2. Multi-token-prediction weights (layers past num_hidden_layers, `mtp.*`) are skipped."""

from __future__ import annotations

import re
from typing import Iterable, Iterator, Set, Tuple

import torch

from gyrfalcon.layers.decoder import DecoderLayer
from gyrfalcon.layers.moe import SIGMOID, SOFTMAX, SparseMoE
from gyrfalcon.models.causal_lm import CausalLM
from gyrfalcon.models.llama import rotary_attention

MINIMAX_STACKED_PARAMS = (
    (".q_proj", ".qkv_proj", "q"),
    (".k_proj", ".qkv_proj", "k"),
    (".v_proj", ".qkv_proj", "v"),
)
MINIMAX_EXPERT_PARAMS = (("w1", "w13", 0), ("w3", "w13", 1), ("w2", "w2", None))
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class MiniMaxM2ForCausalLM(CausalLM):
    stacked_params = MINIMAX_STACKED_PARAMS
    expert_params = MINIMAX_EXPERT_PARAMS
    # Attention heads split (the whole-projection q/k norm reduced across ranks: layers/self_attention.py), the
    # experts split inside each expert or whole per rank.
    supports_tensor_parallel = True

    def build_layer(self, config, layer_idx: int, max_position: int) -> DecoderLayer:
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"Unsupported hidden_act {act!r}: gyrfalcon's experts are SwiGLU (silu).")
        attn = rotary_attention(config, layer_idx, max_position, qk_norm=True, qk_norm_whole=True)
        scoring = getattr(config, "scoring_func", SIGMOID) or SIGMOID
        if scoring not in (SIGMOID, SOFTMAX):
            raise ValueError(f"Unsupported MiniMax-M2 scoring_func {scoring!r}.")
        mlp = SparseMoE(config.hidden_size, config.num_local_experts, config.num_experts_per_tok,
                        config.intermediate_size, scoring=scoring, norm_topk_prob=True,
                        use_bias=scoring == SIGMOID and bool(getattr(config, "use_routing_bias", True)))
        return DecoderLayer(config.hidden_size, config.rms_norm_eps, attn, mlp)

    def _checkpoint_names(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Iterator[Tuple[str, torch.Tensor]]:
        """MiniMax's checkpoint names -> this model's; MTP weights dropped."""
        num_layers = self.config.num_hidden_layers
        for name, tensor in weights:
            layer = _LAYER.match(name)
            if name.startswith(("mtp.", "model.mtp.")) or (layer is not None and int(layer.group(1)) >= num_layers):
                continue
            name = name.replace(".block_sparse_moe.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")
            yield name.replace(".block_sparse_moe.", ".mlp."), tensor

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Set[str]:
        return super().load_weights(self._checkpoint_names(weights))
