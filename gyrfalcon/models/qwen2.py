"""Qwen2 / Qwen2.5 dense: Llama's layers with biases on q, k and v (none on o_proj)."""

from __future__ import annotations

from gyrfalcon.layers.decoder import DecoderLayer
from gyrfalcon.models.llama import LlamaForCausalLM


class _QKVBias:
    """`config` as rotary_attention should read it: Qwen2's config has no attention_bias field (its q/k/v
    projections always carry biases, o_proj never), so the bias flags are answered here and every other
    attribute by the config itself."""

    attention_bias = True
    o_proj_bias = False

    def __init__(self, config) -> None:
        self._config = config

    def __getattr__(self, name):
        return getattr(self._config, name)


def check_sliding_window(config, max_position: int, layer_uses_window) -> None:
    """Full attention stands in for a sliding window only where no sequence can outgrow the window: a query at
    position p attends to keys in (p - window, p], so with positions < max_position the window never cuts
    anything when window >= max_position. Otherwise refuse rather than attend further back than the model
    was trained to."""
    window = getattr(config, "sliding_window", None)
    if window is None or not layer_uses_window or int(window) >= max_position:
        return
    raise ValueError(
        f"{type(config).__name__} uses sliding-window attention (sliding_window={window}), which gyrfalcon does "
        f"not implement; it matches full attention only while sequences stay within the window: pass "
        f"--max-model-len {window} (or less), not {max_position}.")


class Qwen2ForCausalLM(LlamaForCausalLM):
    def build_layer(self, config, layer_idx: int, max_position: int) -> DecoderLayer:
        types = getattr(config, "layer_types", None)
        sliding = (types[layer_idx] == "sliding_attention" if types
                   else bool(getattr(config, "use_sliding_window", False)))
        check_sliding_window(config, max_position, sliding)
        return super().build_layer(_QKVBias(config), layer_idx, max_position)
