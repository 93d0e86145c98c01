"""MtpProposer: k drafts per sequence from the target's own multi-token-prediction layers (DeepSeek-V3 / V3.2:
spec_decode/mtp_deepseek.py; Qwen3-Next / Qwen3.5: spec_decode/mtp_qwen3_next.py, the hybrid target's state rolled
back by the runner after rejected drafts: layers/gated_deltanet.py), the EAGLE-3 proposer's scheme
(spec_decode/eagle3.py) with the MTP layer as the draft head:

1. after each step, one pass of MTP layer 0 over every position the step verified or prefilled: position p takes
   the target's final-normed hidden state of p and the token at p + 1, so the layer's K/V covers every verified
   position; the last position's output gives draft 1;
2. k - 1 one-token chained passes for the sampling rows, pass s through MTP layer s % n_mtp, each feeding the
   previous pass's output (the layer's residual stream) and argmax.

The target's final hidden state comes from the aux-hidden capture (models/causal_lm.py) at layer index N (the
residual stream after the last layer), normed here with the target's final norm: the decode and verify graphs
already return it, and the runner needs nothing MTP-specific. Each MTP layer's K/V is one more paged layer of the
cache plan after the target's, under the requests' block tables (prefix-cache hits carry it). The released
checkpoints have one MTP layer; with more, layers past the first see K/V only from their own chained passes
(vLLM's behaviour too): their drafts are weaker, never wrong, since verification decides.
"""

from __future__ import annotations

from gyrfalcon.spec_decode.eagle3 import Eagle3Proposer


class MtpProposer(Eagle3Proposer):
    uses_target_hidden = True

    def __init__(self, config, target_model, device, layer_idx: int) -> None:
        """layer_idx: the first MTP layer's index in the cache plan (one past the target's last cached layer)."""
        import torch

        sc = config.speculative_config
        self.k = sc.num_speculative_tokens
        inner = getattr(target_model, "model", None)
        if not callable(getattr(target_model, "build_mtp_layer", None)) or not hasattr(inner, "aux_hidden_layers"):
            raise ValueError(f"speculative_config method 'mtp': {type(target_model).__name__} has no MTP layers "
                             "gyrfalcon can run (DeepSeek-V3 / V3.2 do); use eagle3 or ngram.")
        if getattr(config.model_config, "quant_config", None) is not None:
            raise ValueError("speculative_config method 'mtp' with a quantized target (FP8) is not supported yet; "
                             "use eagle3 or ngram.")
        if target_model.mtp_format == "qwen3_next":
            from gyrfalcon.spec_decode.mtp_qwen3_next import load_qwen3_next_mtp as load
        else:
            from gyrfalcon.spec_decode.mtp_deepseek import load_deepseek_mtp as load
        self.layers = load(sc.model, target_model, device, config.model_config.torch_dtype, layer_idx,
                           max_position=config.model_config.max_model_len + self.k)
        self.draft = self.layers[0]
        self.aux_layer_ids = [len(inner.layers)]
        inner.aux_hidden_layers = (len(inner.layers),)
        self.aux = None
        self.device = torch.device(device)
        self.kv_caches = None
        self.block_size = 0
        self.graphs = None
        self._hidden_size = target_model.config.hidden_size

    def cache_specs(self, cache_dtype: str) -> dict:
        specs = {}
        for m in self.layers:
            specs.update(m.cache_specs(cache_dtype))
        return specs

    # Draft pass s (0: the catch-up pass) runs and reads MTP layer s % n_mtp: fixed per pass, so a captured chain
    # (spec_decode/draft_graph.py) holds the same layers as the eager one.
    def _head(self, step: int):
        return self.layers[step % len(self.layers)]

    @property
    def draft_hidden_size(self) -> int:
        return self._hidden_size

    @property
    def aux_width(self) -> int:
        return self._hidden_size  # (the residual stream after the target's last layer)
