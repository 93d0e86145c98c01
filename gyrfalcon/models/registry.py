"""Hugging Face architecture name -> gyrfalcon model class."""

from __future__ import annotations

import importlib
from typing import Type

from torch import nn

_MODELS = {
    "LlamaForCausalLM": ("gyrfalcon.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("gyrfalcon.models.qwen2", "Qwen2ForCausalLM"),
    "MistralForCausalLM": ("gyrfalcon.models.mistral", "MistralForCausalLM"),
    "Qwen3ForCausalLM": ("gyrfalcon.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("gyrfalcon.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "MiniMaxM2ForCausalLM": ("gyrfalcon.models.minimax_m2", "MiniMaxM2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("gyrfalcon.models.deepseek_v3", "DeepseekV3ForCausalLM"),
    "DeepseekV32ForCausalLM": ("gyrfalcon.models.deepseek_v3", "DeepseekV32ForCausalLM"),
    "Qwen3NextForCausalLM": ("gyrfalcon.models.qwen3_next", "Qwen3NextForCausalLM"),
    # Qwen3.5 ships as vision-language checkpoints; gyrfalcon serves their language model (text-only saves as
    # *ForCausalLM hold the same tensors without the `language_model.` level).
    "Qwen3_5MoeForConditionalGeneration": ("gyrfalcon.models.qwen3_5", "Qwen3_5MoeForConditionalGeneration"),
    "Qwen3_5MoeForCausalLM": ("gyrfalcon.models.qwen3_5", "Qwen3_5MoeForConditionalGeneration"),
    "Qwen3_5ForConditionalGeneration": ("gyrfalcon.models.qwen3_5", "Qwen3_5ForConditionalGeneration"),
    "Qwen3_5ForCausalLM": ("gyrfalcon.models.qwen3_5", "Qwen3_5ForConditionalGeneration"),
}


def supported_architectures():
    return sorted(_MODELS)


def resolve_model_class(hf_config) -> Type[nn.Module]:
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in _MODELS:
            module, name = _MODELS[arch]
            return getattr(importlib.import_module(module), name)
    raise ValueError(
        f"Unsupported architecture {archs[0] if len(archs) == 1 else archs or '(none in config.json)'}; "
        f"gyrfalcon supports: {', '.join(supported_architectures())}.")
