"""Mistral: Llama's layout (GQA, SwiGLU, RMSNorm, RoPE). Current checkpoints (7B v0.2 / v0.3, Nemo, Small)
set sliding_window to null; v0.1's 4096-token window is honoured only as a limit on max_model_len
(qwen2.check_sliding_window)."""

from __future__ import annotations

from gyrfalcon.layers.decoder import DecoderLayer
from gyrfalcon.models.llama import LlamaForCausalLM
from gyrfalcon.models.qwen2 import check_sliding_window


class MistralForCausalLM(LlamaForCausalLM):
    def build_layer(self, config, layer_idx: int, max_position: int) -> DecoderLayer:
        check_sliding_window(config, max_position, True)
        return super().build_layer(config, layer_idx, max_position)
