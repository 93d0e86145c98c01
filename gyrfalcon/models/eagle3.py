"""EAGLE-3 draft heads: one decoder layer over [embedding, fused target hidden states], read from the three public
checkpoint layouts (docs/spec_decode.md):

- the original EAGLE release: a 1-layer Llama config with draft_vocab_size; weights midlayer.*, fc, norm, lm_head
  over the draft vocabulary, d2t / t2d; no embed_tokens (the target's are used);
- SpecForge (architectures ["LlamaForCausalLMEagle3"]): the same weights, and eagle_config.
  eagle_aux_hidden_state_layer_ids counting "the output of layer k" (one less than gyrfalcon's ids);
- speculators (architectures ["Eagle3Speculator"]): transformer_layer_config (llama or qwen3), weights under
  layers.0.*, norm_before_residual (True when omitted, as vLLM reads it), norm_before_fc (input_norm over the
  3 x target-hidden input of fc), fc_norm (an RMSNorm after fc), norm_output (the normed output is fed back).

Forward of one draft position p (the target's position: hidden states of p, token p + 1):
  h = fc(aux[p])                                    aux: [T, 3 * H_target] (the residual stream entering three
                                                    target layers, ascending), or the previous draft step's output
  e = input_layernorm(embed(token)); n = hidden_norm(h); r = n if norm_before_residual else h
  x = r + o_proj(attention(q/k/v_proj(cat[e, n])))  (q/k/v take 2H inputs; the draft's own RoPE and eps)
  y = x + mlp(post_attention_layernorm(x))
  logits = lm_head(norm(y)) over the draft vocabulary; target id = draft id + d2t[draft id]
  fed back: y (norm(y) with norm_output)
The draft's K/V is one more paged layer of the runner's cache (layer index `layer_idx`, after the target's): the
same block tables, so prefix-cache hits carry the draft's K/V too and the memory budget counts it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from gyrfalcon.layers.attention import Attention
from gyrfalcon.layers.norm import RMSNorm
from gyrfalcon.layers.rotary import RotaryEmbedding, rope_parameters_of

logger = logging.getLogger(__name__)

EAGLE_FORMATS = ("eagle", "specforge", "speculators")


@dataclass
class Eagle3Spec:
    """A draft checkpoint's config, whatever its layout."""

    fmt: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    eps: float
    rope_parameters: dict
    max_position: int
    draft_vocab_size: int
    target_vocab_size: int
    target_hidden_size: int
    qk_norm: bool = False
    attention_bias: bool = False
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    # gyrfalcon's meaning: the residual stream entering these target layers (0: the embedding); None: default.
    aux_layer_ids: Optional[List[int]] = None
    layer_prefix: str = "midlayer."
    extra: Dict = field(default_factory=dict)


class _Cfg:
    """Attribute access over a config dict (rope_parameters_of reads attributes)."""

    def __init__(self, d: dict) -> None:
        self.__dict__.update(d)

    def __getattr__(self, name):
        return None


def detect_format(cfg: dict) -> str:
    archs = cfg.get("architectures") or []
    if cfg.get("speculators_model_type") == "eagle3" or "Eagle3Speculator" in archs:
        return "speculators"
    if any(a.endswith("Eagle3") for a in archs):
        return "specforge"
    if "draft_vocab_size" in cfg:
        return "eagle"
    raise ValueError("Not an EAGLE-3 draft config: no speculators_model_type 'eagle3', no *Eagle3 architecture and "
                     "no draft_vocab_size.")


def parse_eagle3_config(cfg: dict, target_config) -> Eagle3Spec:
    """The draft's config.json (a dict) -> Eagle3Spec, checked against the target's transformers config."""
    fmt = detect_format(cfg)
    if fmt == "speculators":
        layer = dict(cfg.get("transformer_layer_config") or {})
        if not layer:
            raise ValueError("speculators EAGLE-3 config without transformer_layer_config.")
        qk_norm = layer.get("model_type") == "qwen3"
        if layer.get("model_type") not in (None, "llama", "qwen3"):
            raise ValueError(f"EAGLE-3 draft layer type {layer.get('model_type')!r}: llama and qwen3 are supported.")
        aux = cfg.get("eagle_aux_hidden_state_layer_ids")
        prefix = "layers.0."
        nbr = cfg.get("norm_before_residual")
        nbr = True if nbr is None else bool(nbr)
    else:
        layer = cfg
        qk_norm = False
        ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        # SpecForge / SGLang count the output of layer k: the stream entering layer k + 1.
        aux = [i + 1 for i in ids] if ids is not None else None
        prefix = "midlayer."
        nbr = bool(cfg.get("norm_before_residual", False))
    if int(layer.get("num_hidden_layers", 1) or 1) != 1:
        raise ValueError(f"EAGLE-3 drafts of {layer.get('num_hidden_layers')} layers: one layer is supported.")
    act = layer.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"EAGLE-3 draft hidden_act {act!r}: only silu is supported.")
    hidden = int(layer["hidden_size"])
    heads = int(layer["num_attention_heads"])
    target_vocab = int(layer.get("vocab_size") or target_config.vocab_size)
    spec = Eagle3Spec(
        fmt=fmt, hidden_size=hidden, num_heads=heads,
        num_kv_heads=int(layer.get("num_key_value_heads") or heads),
        head_dim=int(layer.get("head_dim") or hidden // heads), intermediate_size=int(layer["intermediate_size"]),
        eps=float(layer.get("rms_norm_eps", 1e-6)),
        # The draft's own RoPE: no rope_theta means base 10000, and the target's scaling does not apply.
        rope_parameters=rope_parameters_of(_Cfg(layer)),
        max_position=int(layer.get("max_position_embeddings") or target_config.max_position_embeddings),
        draft_vocab_size=int(cfg.get("draft_vocab_size") or layer.get("draft_vocab_size") or target_vocab),
        target_vocab_size=target_vocab,
        target_hidden_size=int(cfg.get("target_hidden_size") or layer.get("target_hidden_size")
                               or target_config.hidden_size),
        qk_norm=qk_norm, attention_bias=bool(layer.get("attention_bias", False)), norm_before_residual=nbr,
        norm_before_fc=bool(cfg.get("norm_before_fc", False)), fc_norm=bool(cfg.get("fc_norm", False)),
        norm_output=bool(cfg.get("norm_output", False)), aux_layer_ids=list(aux) if aux is not None else None,
        layer_prefix=prefix)
    if spec.target_vocab_size != target_config.vocab_size:
        raise ValueError(f"The EAGLE-3 draft is for a vocabulary of {spec.target_vocab_size} tokens; the target has "
                         f"{target_config.vocab_size}.")
    if spec.target_hidden_size != target_config.hidden_size:
        raise ValueError(f"The EAGLE-3 draft expects target hidden states of {spec.target_hidden_size}; the target's "
                         f"are {target_config.hidden_size}.")
    return spec


def default_aux_layer_ids(num_layers: int) -> List[int]:
    """vLLM's default: the residual stream entering layers 2, N // 2 and N - 3."""
    ids = [2, num_layers // 2, num_layers - 3]
    if num_layers < 6:
        raise ValueError(f"The target has {num_layers} layers, too few for the default EAGLE-3 aux layers "
                         f"{ids}; name them (speculative_config aux_hidden_state_layer_ids, or the draft's "
                         "eagle_aux_hidden_state_layer_ids).")
    return ids


class Eagle3Draft(nn.Module):
    """The draft head (module docstring). Parameter names are the checkpoints' with the layer prefix and the
    self_attn. / mlp. parts dropped (load_weights maps them)."""

    def __init__(self, spec: Eagle3Spec, target_embed: nn.Module, layer_idx: int,
                 max_positions: Optional[int] = None) -> None:
        """max_positions: the RoPE table's length (the target's max_model_len + k: a draft's config often says
        2048 for a long-context target); the config's max_position_embeddings still anchors RoPE scaling."""
        super().__init__()
        self.spec = s = spec
        H, Ht = s.hidden_size, s.target_hidden_size
        self.input_norm = RMSNorm(3 * Ht, s.eps) if s.norm_before_fc else None
        self.fc = nn.Linear(3 * Ht, H, bias=False)
        self.fc_norm = RMSNorm(H, s.eps) if s.fc_norm else None
        self.input_layernorm = RMSNorm(H, s.eps)
        self.hidden_norm = RMSNorm(H, s.eps)
        self.q_proj = nn.Linear(2 * H, s.num_heads * s.head_dim, bias=s.attention_bias)
        self.k_proj = nn.Linear(2 * H, s.num_kv_heads * s.head_dim, bias=s.attention_bias)
        self.v_proj = nn.Linear(2 * H, s.num_kv_heads * s.head_dim, bias=s.attention_bias)
        self.o_proj = nn.Linear(s.num_heads * s.head_dim, H, bias=False)
        self.attn = Attention(s.num_heads, s.num_kv_heads, s.head_dim, s.head_dim ** -0.5, layer_idx)
        self.q_norm = RMSNorm(s.head_dim, s.eps) if s.qk_norm else None
        self.k_norm = RMSNorm(s.head_dim, s.eps) if s.qk_norm else None
        self.post_attention_layernorm = RMSNorm(H, s.eps)
        self.gate_proj = nn.Linear(H, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(H, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, H, bias=False)
        self.norm = RMSNorm(H, s.eps)
        self.lm_head = nn.Linear(H, s.draft_vocab_size, bias=False)
        self.rotary = RotaryEmbedding(s.head_dim, s.head_dim, max(max_positions or 0, s.max_position),
                                      s.rope_parameters, s.max_position)
        # The target's embedding unless the checkpoint brings its own (load_weights then fills own_embed).
        self.target_embed = [target_embed]  # (a list: not a submodule, so not the draft's parameter)
        self.own_embed: Optional[nn.Embedding] = None
        self.register_buffer("d2t", torch.zeros(s.draft_vocab_size, dtype=torch.int64), persistent=False)
        for p in self.parameters():
            p.requires_grad_(False)

    # ---- loading ------------------------------------------------------------------------------
    def _param_name(self, ckpt_name: str) -> Optional[str]:
        name = ckpt_name
        for lead in ("model.",):
            if name.startswith(lead) and not name.startswith(self.spec.layer_prefix):
                name = name[len(lead):]
        if name.startswith(self.spec.layer_prefix):
            name = name[len(self.spec.layer_prefix):].replace("self_attn.", "").replace("mlp.", "")
        return name

    def load_weights(self, weights) -> None:
        params = dict(self.named_parameters())
        loaded = set()
        for ckpt_name, tensor in weights:
            name = self._param_name(ckpt_name)
            if name == "d2t":
                if tensor.shape != self.d2t.shape:
                    raise ValueError(f"EAGLE-3 d2t has shape {tuple(tensor.shape)}, expected {tuple(self.d2t.shape)}.")
                self.d2t.copy_(tensor.to(torch.int64))
                loaded.add(name)
                continue
            if name == "t2d" or name.startswith(("verifier_", "rotary_emb")):
                continue  # t2d is d2t's inverse as a mask; the verifier's copies are the target's own
            if name == "embed_tokens.weight":
                self.own_embed = nn.Embedding(*tensor.shape, _weight=tensor.to(self.fc.weight.dtype).clone(),
                                              _freeze=True).to(self.fc.weight.device)
                continue
            param = params.get(name)
            if param is None:
                raise ValueError(f"EAGLE-3 checkpoint tensor {ckpt_name!r} has no place in the draft "
                                 f"({self.spec.fmt} layout).")
            if param.shape != tensor.shape:
                raise ValueError(f"EAGLE-3 checkpoint tensor {ckpt_name!r}: shape {tuple(tensor.shape)}, expected "
                                 f"{tuple(param.shape)}.")
            param.data.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"EAGLE-3 checkpoint misses {missing}.")
        if "d2t" not in loaded and self.spec.draft_vocab_size != self.spec.target_vocab_size:
            raise ValueError("EAGLE-3 checkpoint has a draft vocabulary but no d2t mapping to the target's.")

    # ---- forward ------------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.own_embed is not None:
            return self.own_embed(ids)
        return self.target_embed[0](ids)

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """aux: [T, 3 * H_target] -> [T, H] (fc, with the optional norms around it)."""
        aux = aux.to(self.fc.weight.dtype)
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        h = self.fc(aux)
        return self.fc_norm(h) if self.fc_norm is not None else h

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> Tuple:
        """ids, positions: [T]; hidden: [T, H]; inside a forward context whose batch describes these tokens'
        sequences (slot mapping, block tables) and whose caches hold this draft's layer. Returns (the hidden state
        fed back [T, H], the final-normed output [T, H]: logits() of the rows that propose; a long prefill's
        [T, V_draft] would be large and is never needed whole)."""
        s = self.spec
        e = self.input_layernorm(self.embed(ids))
        n = self.hidden_norm(hidden)
        residual = n if s.norm_before_residual else hidden
        x = torch.cat([e, n], dim=-1)
        q = self.q_proj(x).view(-1, s.num_heads, s.head_dim)
        k = self.k_proj(x).view(-1, s.num_kv_heads, s.head_dim)
        v = self.v_proj(x).view(-1, s.num_kv_heads, s.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q.contiguous(), k.contiguous())
        x = residual + self.o_proj(self.attn(q, k.contiguous(), v.contiguous()))
        m = self.post_attention_layernorm(x)
        y = x + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))
        normed = self.norm(y)
        return (normed if s.norm_output else y), normed

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """[N, H] -> draft-vocabulary logits [N, V_draft]."""
        return self.lm_head(normed)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids through d2t's offsets."""
        return draft_ids + self.d2t[draft_ids]


def load_eagle3_draft(path: str, cfg: Optional[dict], target_model: nn.Module, device,
                      dtype: torch.dtype, layer_idx: int, max_positions: Optional[int] = None) -> Eagle3Draft:
    """The draft in directory `path` (config.json + *.safetensors, or the original release's pytorch_model.bin),
    on `device` in `dtype`, sharing the target's embedding unless it brings its own; RoPE over max_positions."""
    from gyrfalcon.models.loader import iterate_safetensors

    if cfg is None:
        cfg = json.loads((Path(path) / "config.json").read_text())
    spec = parse_eagle3_config(cfg, target_model.config)
    draft = Eagle3Draft(spec, target_model.model.embed_tokens, layer_idx, max_positions)
    if list(Path(path).glob("*.safetensors")):
        weights = iterate_safetensors(path)
    elif (Path(path) / "pytorch_model.bin").exists():
        weights = torch.load(Path(path) / "pytorch_model.bin", map_location="cpu", weights_only=True).items()
    else:
        raise FileNotFoundError(f"No *.safetensors (or pytorch_model.bin) in the EAGLE-3 draft {path}.")
    draft.load_weights(weights)
    if draft.own_embed is None and spec.hidden_size != target_model.config.hidden_size:
        raise ValueError(f"The EAGLE-3 draft's hidden size is {spec.hidden_size} and it has no embed_tokens of its "
                         f"own; the target's embedding is {target_model.config.hidden_size} wide.")
    draft = draft.to(device=device, dtype=dtype)  # (floating tensors only: d2t stays int64)
    logger.info("EAGLE-3 draft (%s layout) loaded from %s: hidden %d, draft vocabulary %d", spec.fmt, path,
                spec.hidden_size, spec.draft_vocab_size)
    return draft
