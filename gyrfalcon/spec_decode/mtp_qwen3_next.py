"""Qwen3NextMtpLayer: the multi-token-prediction module of a Qwen3-Next or Qwen3.5 checkpoint (`mtp.*`; Qwen3.5
counts its layers in mtp_num_hidden_layers and may pack the experts), read from the target's own checkpoint.

Forward of one draft position p (the target's position: its hidden state, and the token at p + 1):
  x = fc(cat[pre_fc_norm_embedding(embed(token)), pre_fc_norm_hidden(h)])   fc [H, 2H]; h: [T, H] the target's
                                                    final-normed hidden state at p (the first pass), or the previous
                                                    draft step's output
  y = norm(decoder_layer(x))                        a gated full-attention layer + the target's MLP kind (MoE), its
                                                    K/V one more paged layer of the cache plan (index cache_idx)
  logits = lm_head(y)                               the target's; y is also what the next step is fed
Every norm is zero-centred ((1 + w), as the target's). Checkpoint names: mtp.fc, mtp.pre_fc_norm_embedding,
mtp.pre_fc_norm_hidden, mtp.norm, and mtp.layers.<i>.{self_attn,mlp,input_layernorm,post_attention_layernorm}.*
under transformers' names, loaded through the target class's fused-weight mapping (CausalLM.load_weights)."""

from __future__ import annotations

from typing import Iterable, List, Set, Tuple

import torch
from torch import nn

from gyrfalcon.layers.norm import RMSNorm
from gyrfalcon.layers.norm_linear import fold_norms, norm_stream
from gyrfalcon.models.causal_lm import CausalLM

_OWN = ("fc.", "pre_fc_norm_embedding.", "pre_fc_norm_hidden.", "norm.")


def num_mtp_layers(config) -> int:
    """The checkpoint's MTP layers: num_nextn_predict_layers (Qwen3-Next) or mtp_num_hidden_layers (Qwen3.5)."""
    return int(getattr(config, "num_nextn_predict_layers", None) or getattr(config, "mtp_num_hidden_layers", None)
               or 0)


class Qwen3NextMtpLayer(nn.Module):
    tie_word_embeddings = False  # (CausalLM.load_weights reads these from the module it fills)
    uses_target_head = True

    def __init__(self, target: nn.Module, cache_idx: int, max_position: int) -> None:
        super().__init__()
        cfg = target.config
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.stacked_params = type(target).stacked_params
        self.expert_params = type(target).expert_params
        self.pre_fc_norm_embedding = RMSNorm(H, eps, weight_offset=1.0)
        self.pre_fc_norm_hidden = RMSNorm(H, eps, weight_offset=1.0)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layer = target.build_mtp_layer(cfg, cache_idx, max_position)
        self.norm = RMSNorm(H, eps, weight_offset=1.0)
        self._target = [target]  # (a list: not a submodule)

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]], prefix: str) -> None:
        """Fill from the checkpoint's `mtp.` tensors of this layer (prefix: `mtp.layers.<i>.`)."""
        def own():
            for name, t in weights:
                if name.startswith(prefix):
                    yield "layer." + name[len(prefix):], t
                elif name.startswith("mtp.") and name[4:].startswith(_OWN):
                    yield name[4:], t

        loaded: Set[str] = CausalLM.load_weights(self, own())
        if not loaded:
            raise ValueError("speculative_config method 'mtp': the checkpoint has no mtp.* tensors: it ships no MTP "
                             "layers; use eagle3 or ngram.")
        missing = sorted(CausalLM.expected_weights(self) - loaded)
        if missing:
            raise ValueError(f"The checkpoint's MTP module ({prefix}*) lacks {missing[:10]}"
                             f"{' ...' if len(missing) > 10 else ''}.")
        fold_norms(self)

    def cache_specs(self, cache_dtype: str) -> dict:
        return {m.layer_idx: m.kv_cache_spec(cache_dtype) for m in self.modules()
                if callable(getattr(m, "kv_cache_spec", None)) and hasattr(m, "layer_idx")}

    def combine(self, stream: torch.Tensor) -> torch.Tensor:
        """The target's residual stream after its last layer -> its final-normed hidden state."""
        return self._target[0].model.norm(stream.to(self.fc.weight.dtype))

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> Tuple:
        """ids, positions: [T]; hidden: [T, H] -> (y fed back [T, H], y [T, H]: the LM head's input)."""
        e = self._target[0].model.embed_tokens(ids)
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(e), self.pre_fc_norm_hidden(hidden)], dim=-1))
        h, r = self.layer(positions, x, None)
        y = norm_stream(self.norm, h, r)[0]
        return y, y

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self._target[0].lm_head(normed, fp32=False)

    @staticmethod
    def to_target_ids(ids: torch.Tensor) -> torch.Tensor:
        return ids


def load_qwen3_next_mtp(path: str, target: nn.Module, device, dtype: torch.dtype, cache_idx: int,
                        max_position: int) -> List[Qwen3NextMtpLayer]:
    """The checkpoint's MTP layers (mtp.layers.0 .. n - 1, sharing mtp.fc and the norms), each caching at
    cache_idx + i."""
    from gyrfalcon.models.loader import _default_dtype
    from gyrfalcon.spec_decode.mtp_deepseek import iterate_prefixed

    n = max(num_mtp_layers(target.config), 1)
    layers = []
    for i in range(n):
        with _default_dtype(dtype), torch.device(device):
            m = Qwen3NextMtpLayer(target, cache_idx + i, max_position)
        weights = iterate_prefixed(path, ("mtp.",))
        if callable(getattr(target, "mtp_weights", None)):  # Qwen3.5: packed experts (models/qwen3_5.py)
            weights = target.mtp_weights(weights)
        m.load_weights(weights, f"mtp.layers.{i}.")
        layers.append(m.eval())
    return layers
