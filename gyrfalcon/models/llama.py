"""Llama family (Llama 2/3/3.1, and the base that Qwen3 extends), on gyrfalcon's own layers.

Checkpoint layout is Hugging Face's: q/k/v and gate/up are separate tensors there and fused here.
"""

from __future__ import annotations

from typing import Dict, Iterable, Optional, Set, Tuple

import torch
from torch import nn

from gyrfalcon.layers.activation import SiluAndMul
from gyrfalcon.forward_context import get_forward_context
from gyrfalcon.kernels.fused_qkv_prep import qkv_prep
from gyrfalcon.kernels.rms_norm import apply_row_scale_ref
from gyrfalcon.kernels.small_m_gemv import merged_heads_gemv_triton, norm_gemv, norm_gemv_rows
from gyrfalcon.kernels._common import use_triton
from gyrfalcon.layers.attention import Attention, decode_prep_fusion_enabled, fusion_enabled, small_m_gemv_enabled
from gyrfalcon.layers.embedding import LMHead, VocabEmbedding
from gyrfalcon.layers.linear import Linear, MergedLinear, QKVLinear
from gyrfalcon.layers.norm import RMSNorm, fold_norm_into, fold_norms_enabled
from gyrfalcon.layers.rotary import RotaryEmbedding, rope_parameters_of

# checkpoint name piece -> (fused parameter name piece, shard id)
STACKED_PARAMS = (
    (".q_proj", ".qkv_proj", "q"),
    (".k_proj", ".qkv_proj", "k"),
    (".v_proj", ".qkv_proj", "v"),
    (".gate_proj", ".gate_up_proj", 0),
    (".up_proj", ".gate_up_proj", 1),
)


class LlamaAttention(nn.Module):
    use_qk_norm = False

    def __init__(self, config, layer_idx: int, max_position: int) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or self.hidden_size // self.num_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVLinear(self.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads, bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, self.hidden_size,
                             bias=bool(getattr(config, "o_proj_bias", False)) and bias)
        params = rope_parameters_of(config)
        partial = float(params.get("partial_rotary_factor",
                                   getattr(config, "partial_rotary_factor", 1.0) or 1.0))
        self.rotary_emb = RotaryEmbedding(self.head_dim, int(self.head_dim * partial), max_position, params,
                                          config.max_position_embeddings)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5,
                              layer_idx)
        if self.use_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.fused = fusion_enabled()
        self.fused_decode_prep = decode_prep_fusion_enabled()

    def forward(self, positions: torch.Tensor, x: Optional[torch.Tensor],
                qkv: Optional[torch.Tensor] = None, row_scale=None,
                add_to: Optional[torch.Tensor] = None) -> torch.Tensor:
        """positions: [T]; x: [T, hidden] -> [T, hidden]. qkv: the projection already computed
        (by a fused norm + GEMV), in which case x is not used. Folded norms (LlamaDecoderLayer.forward_folded):
        row_scale = (residual stream [T, hidden], eps) scales each qkv row by its rstd, and o_proj adds its
        output into add_to (the residual stream) in place and returns it."""
        if qkv is None:
            qkv = self.qkv_proj(x)
        if self.fused:
            rot = self.rotary_emb
            if self.fused_decode_prep and get_forward_context().batch.is_decode and use_triton(qkv):
                # The norm + RoPE + K/V store inside the decode-attention launch.
                norms = (self.q_norm.weight if self.use_qk_norm else None,
                         self.k_norm.weight if self.use_qk_norm else None,
                         self.q_norm.eps if self.use_qk_norm else 1e-6)
                if (get_forward_context().batch.decode_merge_o_proj and qkv.shape[0] == 1 and self.o_proj.small_m
                        and add_to is None):
                    # ... and the attention's split merge inside o_proj's GEMV (no reduce launch).
                    parts = self.attn.decode_with_prep(qkv, positions, rot, *norms, partials=True,
                                                       row_scale=row_scale)
                    return merged_heads_gemv_triton(parts, self.o_proj.weight)
                return self.o_proj(self.attn.decode_with_prep(qkv, positions, rot, *norms, row_scale=row_scale),
                                   add_to=add_to)
            # One launch: q/k norm + RoPE + K/V written into the paged cache.
            k_cache, v_cache = self.attn.kv_cache()
            q = qkv_prep(qkv, self.num_heads, self.num_kv_heads, self.head_dim, positions, rot.cos_sin_cache,
                         rot.rotary_dim, rot.is_neox, k_cache, v_cache, get_forward_context().batch.slot_mapping,
                         self.q_norm.weight if self.use_qk_norm else None,
                         self.k_norm.weight if self.use_qk_norm else None,
                         self.q_norm.eps if self.use_qk_norm else 1e-6, row_scale=row_scale)
            return self.o_proj(self.attn(q), add_to=add_to)
        if row_scale is not None:
            qkv = apply_row_scale_ref(qkv, row_scale)
        q, k, v = qkv.split(self.qkv_proj.split_sizes(), dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v), add_to=add_to)


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, {0: intermediate_size, 1: intermediate_size}, bias)
        self.act = SiluAndMul()
        self.down_proj = Linear(intermediate_size, hidden_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention

    def __init__(self, config, layer_idx: int, max_position: int) -> None:
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"Unsupported hidden_act {act!r}: gyrfalcon's Llama MLP is SwiGLU (silu).")
        self.self_attn = self.attention_cls(config, layer_idx, max_position)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size,
                            bool(getattr(config, "mlp_bias", False)))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Decode-sized batches may fold each norm into the GEMV after it (see small_m_gemv);
        # biases are not part of that kernel.
        self.small_m_gemv = small_m_gemv_enabled() and self.self_attn.qkv_proj.bias is None \
            and self.mlp.gate_up_proj.bias is None
        # Rows up to which each norm folds into the GEMV after it (single rows unless
        # GYRFALCON_NORM_GEMV_ROWS / GYRFALCON_NORM_GEMV_GATE_UP_ROWS raise them).
        self.norm_rows_qkv, self.norm_rows_gate_up = norm_gemv_rows()

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        if self.uses_fused_norm_gemv(hidden.shape[0]):
            return self._forward_small_m(positions, hidden, residual)
        # The residual stream is carried separately so each norm fuses the preceding add.
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def uses_fused_norm_gemv(self, rows: int) -> bool:
        """Whether a batch of `rows` takes _forward_small_m (its norms fused into the GEMVs)."""
        return self.small_m_gemv and rows <= max(self.norm_rows_qkv, self.norm_rows_gate_up)

    def forward_folded(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The layer with its norms folded (layers/norm.py fold_norms_enabled: the norm weights already in
        qkv / gate_up): x [T, hidden] is the residual stream, every add so far included; it is updated in
        place (o_proj and down_proj add into it) and returned. No RMSNorm launch: the fused qkv prep (or
        decode attention) and SiLU-and-mul scale their rows by rstd(x)."""
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        qkv = self.self_attn.qkv_proj(x)
        self.self_attn(positions, None, qkv=qkv, row_scale=(x, ln1.eps), add_to=x)
        act = self.mlp.act(self.mlp.gate_up_proj(x), row_scale=(x, ln2.eps))
        return self.mlp.down_proj(act, add_to=x)

    def _forward_small_m(self, positions: torch.Tensor, hidden: torch.Tensor,
                         residual: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        """Same math, fewer launches: [add +] norm + qkv in one kernel, norm + gate_up + SiLU-and-mul
        in another (each where the batch fits its norm_gemv_rows; otherwise the norm, then the layer)."""
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        rows = hidden.shape[0]
        if rows <= self.norm_rows_qkv:
            qkv, new_residual = norm_gemv(hidden, self.self_attn.qkv_proj.weight, ln1.weight, residual, ln1.eps)
            residual = hidden if residual is None else new_residual
        else:
            if residual is None:
                residual, normed = hidden, ln1(hidden)
            else:
                normed, residual = ln1(hidden, residual)
            qkv = self.self_attn.qkv_proj(normed)
        hidden = self.self_attn(positions, None, qkv=qkv)
        if rows <= self.norm_rows_gate_up:
            act, residual = norm_gemv(hidden, self.mlp.gate_up_proj.weight, ln2.weight, residual, ln2.eps,
                                      silu_mul=True)
        else:
            normed, residual = ln2(hidden, residual)
            act = self.mlp.act(self.mlp.gate_up_proj(normed))
        return self.mlp.down_proj(act), residual


class LlamaModel(nn.Module):
    layer_cls = LlamaDecoderLayer

    def __init__(self, config, max_position: int) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.layer_cls(config, i, max_position)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.fold_norms = fold_norms_enabled()  # the weights are folded at load (LlamaForCausalLM.finish_loading)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, src: Optional[torch.Tensor] = None,
                last_sampled: Optional[torch.Tensor] = None) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids, src, last_sampled)
        if self.fold_norms and not self.layers[0].uses_fused_norm_gemv(hidden.shape[0]):
            # hidden is this step's own tensor (the embedding's output): the layers add into it in place.
            for layer in self.layers:
                hidden = layer.forward_folded(positions, hidden)
            return self.norm(hidden)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    model_cls = LlamaModel

    def __init__(self, config, max_position: Optional[int] = None) -> None:
        super().__init__()
        self.config = config
        max_position = max_position or config.max_position_embeddings
        self.model = self.model_cls(config, max_position)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = LMHead(config.vocab_size, config.hidden_size,
                              self.model.embed_tokens if self.tie_word_embeddings else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, src: Optional[torch.Tensor] = None,
                last_sampled: Optional[torch.Tensor] = None) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden]. src: [T] (decode graphs): a token with
        src >= 0 is still on the device, at last_sampled[src]; input_ids holds a placeholder there."""
        return self.model(input_ids, positions, src, last_sampled)

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab], fp32 (fp32=False: the weights' dtype; runner.launch)"""
        return self.lm_head(hidden, fp32)

    def finish_loading(self) -> None:
        """After load_weights (models/loader.py): with folded norms, each decoder layer's norm weights go into
        the GEMMs after them (layers/norm.py fold_norm_into)."""
        if self.model.fold_norms:
            for layer in self.model.layers:
                fold_norm_into(layer.self_attn.qkv_proj.weight, layer.input_layernorm)
                fold_norm_into(layer.mlp.gate_up_proj.weight, layer.post_attention_layernorm)

    def kv_cache_spec(self) -> Dict[str, int]:
        attn = self.model.layers[0].self_attn
        return {"num_layers": len(self.model.layers), "num_kv_heads": attn.num_kv_heads,
                "head_dim": attn.head_dim}

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Set[str]:
        """Copy checkpoint tensors into the (fused) parameters; returns the parameter names filled."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: Set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            shard = None
            for ckpt, fused, sid in STACKED_PARAMS:
                if ckpt in name:
                    name, shard = name.replace(ckpt, fused), sid
                    break
            param = params.get(name)
            if param is None:
                raise ValueError(f"Checkpoint tensor {name!r} has no place in {type(self).__name__}.")
            owner = self.get_submodule(name.rsplit(".", 1)[0])
            loader = getattr(owner, "weight_loader", None)
            if loader is not None and name.endswith(("weight", "bias")) and isinstance(owner, Linear):
                loader(param, tensor, shard)
            else:
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
                if isinstance(module, MergedLinear) and pname == "weight" or (
                        isinstance(module, MergedLinear) and pname == "bias"):
                    out.update(f"{full}#{sid}" for sid in module.shards)
                else:
                    out.add(full)
        return out
