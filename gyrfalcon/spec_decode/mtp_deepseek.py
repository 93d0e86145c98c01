"""DeepseekMtpLayer: one multi-token-prediction module of a DeepSeek-V3 / V3.2 checkpoint
(`model.layers.<num_hidden_layers + i>.*`), read from the target's own checkpoint.

Forward of one draft position p (the target's position: its hidden state, and the token at p + 1):
  e = embed(token)                         the target's embedding; zero at position 0 (vLLM's rule: the
                                           MTP never predicts from the first position's pair)
  x = eh_proj(cat[enorm(e), hnorm(h)])     h: [T, H] the target's final-normed hidden state at p (the first
                                           pass), or the previous draft step's output
  y = decoder_layer(x)                     a full DeepSeek layer (MLA, the V3.2 indexer, MoE) whose K/V is one
                                           more paged layer of the cache plan (index cache_idx)
  logits = head(shared_head.norm(y))       head: shared_head.head, or the target's lm_head when the
                                           checkpoint has none; y (the residual stream, before that norm) is
                                           fed back to the next step
Checkpoint names past the prefix: enorm, hnorm, eh_proj, shared_head.{norm,head}, embed_tokens (a copy of the
target's: not loaded), and the decoder layer's self_attn.* / mlp.* / *_layernorm under transformers' names,
loaded through the target class's fused-weight mapping (CausalLM.load_weights)."""

from __future__ import annotations

from typing import Iterable, List, Set, Tuple

import torch
from torch import nn

from gyrfalcon.layers.embedding import LMHead
from gyrfalcon.layers.mla import MultiHeadLatentAttention
from gyrfalcon.layers.norm import RMSNorm
from gyrfalcon.layers.norm_linear import fold_norms, norm_stream
from gyrfalcon.models.causal_lm import CausalLM

_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")


def num_mtp_layers(config) -> int:
    """num_nextn_predict_layers of a DeepSeek config (0: no MTP weights)."""
    return int(getattr(config, "num_nextn_predict_layers", 0) or 0)


class DeepseekMtpLayer(nn.Module):
    # CausalLM.load_weights reads these from the module it fills.
    tie_word_embeddings = False

    def __init__(self, target: nn.Module, cache_idx: int, max_position: int) -> None:
        super().__init__()
        cfg = target.config
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.stacked_params = type(target).stacked_params
        self.expert_params = type(target).expert_params
        self.enorm = RMSNorm(H, eps)
        self.hnorm = RMSNorm(H, eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.layer = target.build_mtp_layer(cfg, cache_idx, max_position)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(H, eps)
        self.shared_head.head = LMHead(cfg.vocab_size, H)
        # The target's modules, out of this module's parameters (lists are not submodules).
        self._target = [target]
        self.uses_target_head = False

    # ---- loading ------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]], prefix: str) -> None:
        """Fill from the checkpoint's tensors under `prefix` (`model.layers.<N>.`); the others are the target's."""
        def own():
            for name, t in weights:
                if not name.startswith(prefix):
                    continue
                name = name[len(prefix):]
                if name.startswith("embed_tokens."):
                    continue
                yield (name if name.startswith(_OWN) else "layer." + name), t

        loaded: Set[str] = CausalLM.load_weights(self, own())
        if not loaded:  # (transformers' DeepseekV3Config says num_nextn_predict_layers 1 for any checkpoint)
            raise ValueError(f"speculative_config method 'mtp': the checkpoint has no {prefix}* tensors: it ships no "
                             "MTP layers; use eagle3 or ngram.")
        expected = CausalLM.expected_weights(self)
        if "shared_head.head.weight" not in loaded:  # the target's LM head serves
            self.shared_head.head = None
            self.uses_target_head = True
            expected = {n for n in expected if not n.startswith("shared_head.head.")}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"The checkpoint's MTP layer ({prefix}*) lacks {missing[:10]}"
                             f"{' ...' if len(missing) > 10 else ''}.")
        for m in self.modules():
            if isinstance(m, MultiHeadLatentAttention):
                m.forget_absorbed()
        fold_norms(self)

    def cache_specs(self, cache_dtype: str) -> dict:
        return {m.layer_idx: m.kv_cache_spec(cache_dtype) for m in self.modules()
                if callable(getattr(m, "kv_cache_spec", None)) and hasattr(m, "layer_idx")}

    # ---- forward ------------------------------------------------------------------------------
    def combine(self, stream: torch.Tensor) -> torch.Tensor:
        """The target's residual stream after its last layer [T, H] -> its final-normed hidden state (what the
        target's LM head reads: the MTP's h at the first pass)."""
        return self._target[0].model.norm(stream.to(self.eh_proj.weight.dtype))

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> Tuple:
        """ids, positions: [T]; hidden: [T, H]; inside a forward context whose batch describes these tokens and
        whose caches hold this layer's. Returns (y fed back [T, H], shared_head.norm(y) [T, H])."""
        e = self._target[0].model.embed_tokens(ids)
        e = torch.where((positions == 0).unsqueeze(-1), torch.zeros_like(e), e)
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden)], dim=-1))
        h, r = self.layer(positions, x, None)
        normed, y = norm_stream(self.shared_head.norm, h, r)
        return y, normed

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        head = self._target[0].lm_head if self.uses_target_head else self.shared_head.head
        return head(normed, fp32=False)

    @staticmethod
    def to_target_ids(ids: torch.Tensor) -> torch.Tensor:
        return ids  # the MTP predicts over the target's vocabulary


def iterate_prefixed(path: str, prefixes: Tuple[str, ...]) -> Iterable[Tuple[str, torch.Tensor]]:
    """(name, tensor) of the checkpoint's tensors whose names start with one of `prefixes`, reading no other
    tensor (a released DeepSeek checkpoint is hundreds of GB; its MTP layer a few)."""
    from pathlib import Path

    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"No *.safetensors weight files in {path}.")
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in sf.keys():
                if name.startswith(prefixes):
                    yield name, sf.get_tensor(name)


def load_deepseek_mtp(path: str, target: nn.Module, device, dtype: torch.dtype, cache_idx: int,
                      max_position: int) -> List[DeepseekMtpLayer]:
    """The checkpoint's MTP layers (model.layers.N .. N + n - 1), each caching at cache_idx + i."""
    from gyrfalcon.models.loader import _default_dtype

    cfg = target.config
    n, N = num_mtp_layers(cfg), cfg.num_hidden_layers
    if n < 1:
        raise ValueError("speculative_config method 'mtp': the model's config has no num_nextn_predict_layers: it "
                         "ships no MTP layers; use eagle3 or ngram.")
    layers = []
    for i in range(n):
        with _default_dtype(dtype), torch.device(device):
            m = DeepseekMtpLayer(target, cache_idx + i, max_position)
        m.load_weights(iterate_prefixed(path, (f"model.layers.{N + i}.",)), f"model.layers.{N + i}.")
        layers.append(m.eval())
    return layers
