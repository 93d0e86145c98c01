"""Quantized weights for the linear layers and the MoE experts (config.py QuantizationConfig selects them). fp8.py:
float8_e4m3fn weights with block scales (as checkpoints ship them) or, quantized at load, per-channel scales for
linears and 128 x 128 block scales for experts."""

from gyrfalcon.layers.quantization.fp8 import (current_weight_block, fp8_scope, is_quantized, matches_module,
                                               prepare_model, quantize_model_per_channel)

__all__ = ["current_weight_block", "fp8_scope", "is_quantized", "matches_module", "prepare_model",
           "quantize_model_per_channel"]
