"""A trained head in the speculators layout (the one vLLM's speculators loader and models/eagle3.py read):

config.json   speculators_model_type "eagle3", architectures ["Eagle3Speculator"], transformer_layer_config (a
              one-layer llama config of the target's width), draft_vocab_size, target_hidden_size,
              norm_before_residual, eagle_aux_hidden_state_layer_ids (the stream entering those target layers),
              speculators_config (algorithm, proposal_methods with speculative_tokens, the verifier)
model.safetensors  layers.0.self_attn.{q,k,v,o}_proj, layers.0.mlp.{gate,up,down}_proj, layers.0.{input_layernorm,
              hidden_norm, post_attention_layernorm}, fc, norm, lm_head [V_draft, H], d2t [V_draft], t2d [V_target]
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Sequence

import torch

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
_MLP = ("gate_proj", "up_proj", "down_proj")
_LAYER = ("input_layernorm", "hidden_norm", "post_attention_layernorm")


def draft_config(target_hf_config, target_name: str, draft_vocab_size: int, aux_layer_ids: Sequence[int],
                 num_speculative_tokens: int) -> dict:
    """The speculators config.json of a head as wide as the target (its attention and MLP shapes)."""
    from gyrfalcon.layers.rotary import rope_parameters_of

    c = target_hf_config
    heads = int(c.num_attention_heads)
    rope = rope_parameters_of(c)
    theta = rope.pop("rope_theta")
    layer = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": int(c.hidden_size),
             "num_attention_heads": heads, "num_key_value_heads": int(getattr(c, "num_key_value_heads", None) or heads),
             "head_dim": int(getattr(c, "head_dim", None) or c.hidden_size // heads),
             "intermediate_size": int(c.intermediate_size), "rms_norm_eps": float(c.rms_norm_eps),
             "max_position_embeddings": int(c.max_position_embeddings), "vocab_size": int(c.vocab_size),
             "num_hidden_layers": 1, "hidden_act": "silu", "attention_bias": False, "rope_theta": float(theta),
             "rope_scaling": rope if rope.get("rope_type", "default") != "default" else None,
             "tie_word_embeddings": False}
    return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "transformer_layer_config": layer, "draft_vocab_size": int(draft_vocab_size),
            "target_hidden_size": int(c.hidden_size), "norm_before_residual": True,
            "eagle_aux_hidden_state_layer_ids": [int(i) for i in aux_layer_ids],
            "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy",
                                                         "speculative_tokens": int(num_speculative_tokens)}],
                                   "verifier": {"name_or_path": target_name,
                                                "architectures": list(getattr(c, "architectures", None) or [])}},
            "torch_dtype": "float32"}


def speculators_tensors(draft, t2d: torch.Tensor, dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    """Eagle3Draft's parameters under the speculators names, plus d2t / t2d."""
    out: Dict[str, torch.Tensor] = {}
    for name, p in draft.named_parameters():
        module = name.split(".", 1)[0]
        key = (f"layers.0.self_attn.{name}" if module in _ATTN else f"layers.0.mlp.{name}" if module in _MLP
               else f"layers.0.{name}" if module in _LAYER else name)
        out[key] = p.detach().to("cpu", dtype).contiguous()
    out["d2t"] = draft.d2t.detach().cpu().to(torch.int64).contiguous()
    out["t2d"] = t2d.cpu().contiguous()
    return out


def save_speculators(out_dir: Path, cfg: dict, draft, t2d: torch.Tensor, dtype: torch.dtype) -> None:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = dict(cfg, torch_dtype=str(dtype).replace("torch.", ""))
    save_file(speculators_tensors(draft, t2d, dtype), str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
