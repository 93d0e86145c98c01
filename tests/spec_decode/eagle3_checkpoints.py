"""Tiny random EAGLE-3 draft checkpoints in the three public layouts (gyrfalcon/models/eagle3.py), for a target
written by tests/checkpoints.py. The same seed gives the same weights in every layout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional, Sequence

import torch
from safetensors.torch import save_file

DRAFT = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96, rms_norm_eps=1e-5,
             max_position_embeddings=1024, num_hidden_layers=1, hidden_act="silu")


def draft_tensors(H: int, vocab: int, draft_vocab: int, seed: int, qk_norm: bool = False,
                  norm_before_fc: bool = False, fc_norm: bool = False) -> Dict[str, torch.Tensor]:
    """The layer's tensors under gyrfalcon's names with the layer prefix dropped ("q_proj.weight", ...), plus fc,
    norm, lm_head and d2t / t2d (a random sorted subset of the target vocabulary when draft_vocab < vocab)."""
    g = torch.Generator().manual_seed(seed)
    hd, h, kvh, inter = DRAFT["head_dim"], DRAFT["num_attention_heads"], DRAFT["num_key_value_heads"], \
        DRAFT["intermediate_size"]

    def lin(o, i):
        return torch.randn(o, i, generator=g) / i ** 0.5

    def norm(n):
        return 1 + 0.1 * torch.randn(n, generator=g)
    t = {"self_attn.q_proj.weight": lin(h * hd, 2 * H), "self_attn.k_proj.weight": lin(kvh * hd, 2 * H),
         "self_attn.v_proj.weight": lin(kvh * hd, 2 * H), "self_attn.o_proj.weight": lin(H, h * hd),
         "mlp.gate_proj.weight": lin(inter, H), "mlp.up_proj.weight": lin(inter, H),
         "mlp.down_proj.weight": lin(H, inter),
         "input_layernorm.weight": norm(H), "hidden_norm.weight": norm(H), "post_attention_layernorm.weight": norm(H)}
    if qk_norm:
        t["self_attn.q_norm.weight"] = norm(hd)
        t["self_attn.k_norm.weight"] = norm(hd)
    top = {"fc.weight": lin(H, 3 * H), "norm.weight": norm(H),
           # A sharp head: its argmax is what the draft proposes.
           "lm_head.weight": 4 * lin(draft_vocab, H)}
    if norm_before_fc:
        top["input_norm.weight"] = norm(3 * H)
    if fc_norm:
        top["fc_norm.weight"] = norm(H)
    ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    top["d2t"] = ids - torch.arange(draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    top["t2d"] = t2d
    return {"layer": t, "top": top}


def make_eagle3_draft(path, target: Path, fmt: str, aux_ids: Optional[Sequence[int]] = None, seed: int = 0,
                      draft_vocab: int = 200, k: int = 3, **options) -> Path:
    """Write a draft for `target` in layout fmt ('eagle' | 'specforge' | 'speculators'). aux_ids: gyrfalcon's
    meaning (the stream entering those layers), written as each layout counts them (SpecForge: one less; the
    original EAGLE layout has none). options: qk_norm (speculators with a qwen3 layer), norm_before_residual,
    norm_before_fc, fc_norm, norm_output (speculators)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tcfg = json.loads((Path(target) / "config.json").read_text())
    H, vocab = tcfg["hidden_size"], tcfg["vocab_size"]
    qk_norm = options.pop("qk_norm", False)
    ts = draft_tensors(H, vocab, draft_vocab, seed, qk_norm, options.get("norm_before_fc", False),
                       options.get("fc_norm", False))
    layer = dict(DRAFT, hidden_size=H, vocab_size=vocab, draft_vocab_size=draft_vocab)
    if fmt == "speculators":
        layer_cfg = {k_: v for k_, v in layer.items() if k_ != "draft_vocab_size"}
        layer_cfg["model_type"] = "qwen3" if qk_norm else "llama"
        cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
               "transformer_layer_config": layer_cfg, "draft_vocab_size": draft_vocab, "target_hidden_size": H,
               "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                      "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k}],
                                      "verifier": {"name_or_path": str(target),
                                                   "architectures": tcfg["architectures"]}},
               **options}
        if aux_ids is not None:
            cfg["eagle_aux_hidden_state_layer_ids"] = list(aux_ids)
        prefix = "layers.0."
        top = dict(ts["top"])
    else:
        assert not options and not qk_norm, "the original / SpecForge layouts have none of these options"
        cfg = dict(layer, model_type="llama")
        cfg["architectures"] = ["LlamaForCausalLMEagle3"] if fmt == "specforge" else ["LlamaForCausalLM"]
        if fmt == "specforge" and aux_ids is not None:
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux_ids]}
        prefix = "midlayer."
        top = dict(ts["top"])
    tensors = {prefix + n: v.contiguous() for n, v in ts["layer"].items()}
    tensors.update(top)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path
