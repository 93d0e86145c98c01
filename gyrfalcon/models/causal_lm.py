"""The decoder-only causal LM that the model files fill in: embedding, decoder layers, final norm, LM head,
checkpoint loading and the cache specs. A model file supplies build_layer (its config -> blocks mapping) and
stacked_params (checkpoint tensors that land in fused weights)."""

from __future__ import annotations

import re
from typing import Dict, Iterable, List, Optional, Set, Tuple

import torch
from torch import nn

from gyrfalcon.cache_spec import CacheSpec
from gyrfalcon.distributed import (as_tensor, pp_broadcast_from_last, pp_layers, pp_rank, pp_recv_prev, pp_send_next,
                                  pp_size)
from gyrfalcon.layers.embedding import LMHead, VocabEmbedding
from gyrfalcon.layers.linear import Linear, MergedLinear
from gyrfalcon.layers.norm import RMSNorm
from gyrfalcon.layers.norm_linear import norm_stream


class MissingLayer(nn.Module):
    """The place of a decoder layer that another pipeline stage holds: no parameters, no cache, never run."""

    def forward(self, *args):
        raise RuntimeError("A decoder layer of another pipeline stage was run here.")


class DecoderModel(nn.Module):
    """ids [T] -> embed -> layers -> final RMSNorm -> hidden [T, hidden].

    Pipeline parallelism (docs/parallelism.md): this stage holds layers [start, end) (the rest are MissingLayers).
    A stage after the first receives the residual stream [T, hidden] from the one before instead of embedding; a
    stage before the last sends its stream on (hidden + residual summed: the next layer's input norm would add them
    first anyway, so one tensor crosses instead of two). The last stage's final hidden states are broadcast to every
    stage, so that each computes the same logits and samples the same tokens (the embedding, final norm and LM head
    are on every stage: one step at a time, their memory the price of no token exchange)."""

    def __init__(self, vocab_size: int, hidden_size: int, eps: float, layers: List[nn.Module],
                 layer_range: Optional[Tuple[int, int]] = None, num_stages: int = 1) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden_size, eps)
        # EAGLE-3 drafts read the residual stream entering these layers (0: the embedding output, N: the last
        # layer's output before the final norm); each step's copies land in aux_hidden [T, len(ids) * hidden].
        self.aux_hidden_layers: Tuple[int, ...] = ()
        self.aux_hidden: Optional[torch.Tensor] = None
        self.layer_range = layer_range or (0, len(layers))
        self.num_stages = num_stages
        self.hidden_size = hidden_size

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, src: Optional[torch.Tensor] = None,
                last_sampled: Optional[torch.Tensor] = None) -> torch.Tensor:
        start, end = self.layer_range
        stage = pp_rank() if self.num_stages > 1 else 0
        if stage == 0:
            # The embedding's output is this step's own tensor: folded layers add into it in place.
            hidden, residual = self.embed_tokens(input_ids, src, last_sampled), None
        else:
            hidden = pp_recv_prev((input_ids.shape[0], self.hidden_size), self.norm.weight.dtype, input_ids.device)
            residual = None
        # (aux capture serves speculative decoding's drafts, which tensor / pipeline parallelism refuse for now)
        aux = [] if self.aux_hidden_layers else None
        for i in range(start, end):
            if aux is not None and i in self.aux_hidden_layers:
                aux.append(_stream_copy(hidden, residual))
            hidden, residual = self.layers[i](positions, hidden, residual)
        if aux is not None:
            if len(self.layers) in self.aux_hidden_layers:
                aux.append(_stream_copy(hidden, residual))
            self.aux_hidden = torch.cat(aux, dim=-1)
        if self.num_stages == 1:
            return norm_stream(self.norm, hidden, residual)[0]
        if stage < self.num_stages - 1:
            pp_send_next(residual if hidden is None else hidden if residual is None else residual + hidden)
            out = torch.empty(input_ids.shape[0], self.hidden_size, dtype=self.norm.weight.dtype,
                              device=input_ids.device)
        else:
            out = norm_stream(self.norm, hidden, residual)[0].contiguous()
        return pp_broadcast_from_last(out)

    def owns_layer(self, i: int) -> bool:
        return self.layer_range[0] <= i < self.layer_range[1]


def _stream_copy(hidden: Optional[torch.Tensor], residual: Optional[torch.Tensor]) -> torch.Tensor:
    """The residual stream's value (hidden + residual, either side absent: layers/norm_linear.py) as a new tensor:
    later layers add into the stream's tensors in place."""
    if hidden is None:
        return residual.clone()
    if residual is None:
        return hidden.clone()
    return hidden + residual


# A per-expert checkpoint tensor: (the experts module's name, expert index, projection name, weight or its FP8
# block scales weight_scale_inv).
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT_TENSOR = re.compile(r"^(.*\.experts)\.(\d+)\.([^.]+)\.(weight|weight_scale_inv)$")


def _check_expert_dtype(param: nn.Parameter, tensor: torch.Tensor, ckpt_name: str) -> None:
    """An expert weight's dtype must match the experts' quantization: e4m3 into FP8 experts (a bf16 tensor there
    would be cast to e4m3 without a scale), and no float8 tensor into unquantized ones (its values mean nothing
    without the scales the model has no place for)."""
    fp8 = torch.float8_e4m3fn
    if param.dtype == fp8 and tensor.dtype != fp8:
        raise ValueError(f"Checkpoint tensor {ckpt_name!r} is {tensor.dtype}, but the quantization_config makes these "
                         f"experts FP8 ({fp8} with weight_scale_inv); list them in modules_to_not_convert if the "
                         "checkpoint ships them unquantized.")
    if param.dtype != fp8 and tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"Checkpoint tensor {ckpt_name!r} is {tensor.dtype}, but these experts are unquantized "
                         "(no fp8 quantization_config with weight_block_size, or modules_to_not_convert lists them).")


class CausalLM(nn.Module):
    """Subclasses: build_layer(config, layer_idx, max_position) -> a decoder layer; stacked_params: (checkpoint
    name piece, fused parameter name piece, shard id) for the tensors that a fused weight holds; expert_params:
    (per-expert projection name, stacked parameter name, half) for MoE checkpoints, whose
    `<...>.experts.<e>.<projection>.weight` tensors land in `<...>.experts.<stacked>` [E, ...] at shard
    (e, half) (layers/moe.py FusedExperts: half 0 / 1 the gate / up rows of w13, None all of w2[e]); an FP8
    checkpoint's `<...>.experts.<e>.<projection>.weight_scale_inv` in `<...>.experts.<stacked>_weight_scale_inv`
    at the same shard."""

    stacked_params: Tuple[Tuple[str, str, object], ...] = ()
    expert_params: Tuple[Tuple[str, str, Optional[int]], ...] = ()
    # Whether the family builds its layers sharded for tensor parallelism (column / row-parallel projections,
    # split heads and experts; docs/parallelism.md). The loader refuses tensor_parallel_size > 1 otherwise.
    supports_tensor_parallel = False

    def __init__(self, config, max_position: Optional[int] = None) -> None:
        super().__init__()
        self.config = config
        max_position = max_position or config.max_position_embeddings
        # (pipeline parallel: this stage builds its layers only)
        start, end = pp_layers(config.num_hidden_layers)
        self.model = DecoderModel(config.vocab_size, config.hidden_size, config.rms_norm_eps,
                                  [self.build_layer(config, i, max_position) if start <= i < end else MissingLayer()
                                   for i in range(config.num_hidden_layers)], (start, end), pp_size())
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = LMHead(config.vocab_size, config.hidden_size,
                              self.model.embed_tokens if self.tie_word_embeddings else None)

    def build_layer(self, config, layer_idx: int, max_position: int) -> nn.Module:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, src: Optional[torch.Tensor] = None,
                last_sampled: Optional[torch.Tensor] = None) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden]. src: [T] (decode graphs): a token with
        src >= 0 is still on the device, at last_sampled[src]; input_ids holds a placeholder there."""
        return self.model(input_ids, positions, src, last_sampled)

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab], fp32 (fp32=False: the weights' dtype)."""
        return self.lm_head(hidden, fp32)

    def kv_cache_specs(self, cache_dtype: str) -> Dict[int, CacheSpec]:
        """{layer index: what that layer caches} (gyrfalcon/cache_spec.py), from every module that declares one
        (layers/attention Attention.kv_cache_spec); cache_dtype: a torch dtype's name ("bfloat16", ...)."""
        return {m.layer_idx: m.kv_cache_spec(cache_dtype) for m in self.modules()
                if callable(getattr(m, "kv_cache_spec", None)) and hasattr(m, "layer_idx")}

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Set[str]:
        """Copy checkpoint tensors into the (fused) parameters; returns the parameter names filled (a fused
        weight's shards as name#shard). Under tensor parallelism the tensors are CheckpointSlices
        (gyrfalcon/distributed): the sharded layers' weight_loaders read their rank's part, the rest whole."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: Set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            layer = _LAYER_NAME.match(name)
            if layer is not None and not self.model.owns_layer(int(layer.group(1))):
                continue  # another pipeline stage's layer
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            shard = None
            expert = _EXPERT_TENSOR.match(name) if self.expert_params else None
            if expert is not None:
                suffix = "_weight_scale_inv" if expert.group(4) == "weight_scale_inv" else ""
                for proj, stacked, half in self.expert_params:
                    if expert.group(3) == proj:
                        ckpt_name = name
                        name, shard = f"{expert.group(1)}.{stacked}{suffix}", (int(expert.group(2)), half)
                        break
                else:
                    raise ValueError(f"Checkpoint tensor {name!r}: unknown expert projection {expert.group(3)!r}.")
            else:
                for ckpt, fused, sid in self.stacked_params:
                    if ckpt in name:
                        name, shard = name.replace(ckpt, fused), sid
                        break
            param = params.get(name)
            if param is None and expert is not None and suffix:
                raise ValueError(f"Checkpoint tensor {ckpt_name!r} is an FP8 expert scale, but these experts are "
                                 "unquantized (no fp8 quantization_config, or modules_to_not_convert lists them).")
            if param is None:
                raise ValueError(f"Checkpoint tensor {name!r} has no place in {type(self).__name__}.")
            owner = self.get_submodule(name.rsplit(".", 1)[0])
            if expert is not None:
                if not suffix:
                    _check_expert_dtype(param, tensor, ckpt_name)
                owner.weight_loader(param, tensor, shard)
            elif isinstance(owner, Linear) and name.endswith(("weight", "bias")):
                owner.weight_loader(param, tensor, shard)
            elif isinstance(owner, (VocabEmbedding, LMHead)):  # this rank's vocabulary rows
                owner.weight_loader(param, tensor)
            elif getattr(param, "shard_loader", None) is not None:  # a sharded parameter of no Linear (GDN's conv)
                param.shard_loader(param, tensor)
            else:
                tensor = as_tensor(tensor)  # replicated on every rank: read whole
                if param.shape != tensor.shape:
                    raise ValueError(f"Shape mismatch for {name}: {tuple(param.shape)} vs "
                                     f"checkpoint {tuple(tensor.shape)}.")
                param.data.copy_(tensor)
            loaded.add(name if shard is None else f"{name}#{shard}")
        return loaded

    def expected_weights(self) -> Set[str]:
        """Names load_weights must report for a complete checkpoint."""
        out: Set[str] = set()
        for name, module in self.named_modules():
            for pname, _ in module.named_parameters(recurse=False):
                full = f"{name}.{pname}" if name else pname
                if full == "lm_head.weight" and self.tie_word_embeddings:
                    continue
                if isinstance(module, MergedLinear) and pname in ("weight", "bias"):
                    out.update(f"{full}#{sid}" for sid in module.shards)
                elif callable(getattr(module, "shard_ids", None)):
                    out.update(f"{full}#{sid}" for sid in module.shard_ids(pname))
                else:
                    out.add(full)
        return out
