"""Tiny DeepSeek-V3 checkpoints with their multi-token-prediction layer in the released layout."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from checkpoints import make_deepseek_checkpoint


def make_deepseek_mtp_checkpoint(path, seed: int = 0, head: bool = True, v32: bool = False, n_mtp: int = 1,
                                 **overrides) -> Path:
    """make_deepseek_checkpoint's target plus n_mtp MTP modules `model.layers.<N + i>.*` (N = num_hidden_layers):
    each a full decoder layer (MLA, MoE; v32: DeepSeek-V3.2's, with its indexer) taken from an (N + n_mtp)-layer
    transformers model of the same config under another seed (so in transformers' saved names, per-expert tensors
    included), enorm, hnorm, eh_proj [H, 2H], shared_head.norm, shared_head.head (head=False: absent, the target's
    lm_head serves) and embed_tokens (the target's copy), every new tensor random. config.json gets
    num_nextn_predict_layers = n_mtp."""
    path = Path(path)
    make_deepseek_checkpoint(path, seed, v32=v32, num_nextn_predict_layers=n_mtp, **overrides)
    cfg = json.loads((path / "config.json").read_text())
    N, H, V = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    donor = make_deepseek_checkpoint(path.parent / (path.name + "-mtp-donor"), seed + 7,
                                     v32=v32, num_hidden_layers=N + n_mtp, **overrides)
    files = sorted(path.glob("*.safetensors"))
    assert len(files) == 1, files
    tensors = {}
    with safe_open(str(files[0]), "pt") as sf:
        for k in sf.keys():
            tensors[k] = sf.get_tensor(k)
    with safe_open(str(next(donor.glob("*.safetensors"))), "pt") as sf:
        for k in sf.keys():
            layer = k.split(".")[2] if k.startswith("model.layers.") else None
            if layer is not None and int(layer) >= N:
                tensors[k] = sf.get_tensor(k)
    g = torch.Generator().manual_seed(seed + 11)
    for i in range(n_mtp):
        p = f"model.layers.{N + i}."
        tensors[p + "enorm.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
        tensors[p + "hnorm.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
        tensors[p + "eh_proj.weight"] = torch.randn(H, 2 * H, generator=g) / (2 * H) ** 0.5
        tensors[p + "shared_head.norm.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
        if head:
            tensors[p + "shared_head.head.weight"] = torch.randn(V, H, generator=g) / H ** 0.5
        tensors[p + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(files[0]), metadata={"format": "pt"})
    return path


def _graft_qwen_mtp(file: Path, donor_file: Path, src: str, H: int, seed: int) -> None:
    """Qwen3-Next / Qwen3.5's MTP module into `file`: mtp.layers.0.* from the donor's layer under `src` (a full
    attention layer), a random mtp.fc [H, 2H] and zero-centred mtp.pre_fc_norm_embedding / pre_fc_norm_hidden /
    norm."""
    with safe_open(str(file), "pt") as sf:
        tensors = {k: sf.get_tensor(k) for k in sf.keys()}
    with safe_open(str(donor_file), "pt") as sf:
        for k in sf.keys():
            if k.startswith(src):
                tensors["mtp.layers.0." + k[len(src):]] = sf.get_tensor(k)
    g = torch.Generator().manual_seed(seed + 11)
    tensors["mtp.fc.weight"] = torch.randn(H, 2 * H, generator=g) / (2 * H) ** 0.5
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{n}.weight"] = 0.1 * torch.randn(H, generator=g)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(file), metadata={"format": "pt"})


def make_qwen3_next_mtp_checkpoint(path, seed: int = 0, **overrides) -> Path:
    """make_qwen3_next_checkpoint's hybrid target plus its MTP module in the released layout: mtp.layers.0.* (a
    gated full-attention layer with MoE) taken from a same-config transformers model under another seed (its layer
    3, full attention in the tiny config), mtp.fc [H, 2H] and the zero-centred mtp.pre_fc_norm_embedding,
    mtp.pre_fc_norm_hidden and mtp.norm, every new tensor random. config.json gets num_nextn_predict_layers = 1."""
    from checkpoints import make_qwen3_next_checkpoint

    path = Path(path)
    make_qwen3_next_checkpoint(path, seed, **overrides)
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    H = cfg["hidden_size"]
    donor = make_qwen3_next_checkpoint(path.parent / (path.name + "-mtp-donor"), seed + 7, **overrides)
    (file,) = path.glob("*.safetensors")
    _graft_qwen_mtp(file, next(donor.glob("*.safetensors")), "model.layers.3.", H, seed)
    return path


def make_qwen3_5_mtp_checkpoint(path, seed: int = 0, **overrides) -> Path:
    """make_qwen3_5_checkpoint's MoE release (packed experts) plus its MTP module as the releases ship it:
    mtp.layers.0.* from a same-config donor's language-model layer 3 (full attention; experts packed), mtp.fc and
    the zero-centred pre-fc norms and mtp.norm, random; text_config.mtp_num_hidden_layers = 1."""
    from checkpoints import make_qwen3_5_checkpoint

    path = Path(path)
    make_qwen3_5_checkpoint(path, seed=seed, **overrides)
    cfg = json.loads((path / "config.json").read_text())
    cfg["text_config"]["mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    H = cfg["text_config"]["hidden_size"]
    donor = make_qwen3_5_checkpoint(path.parent / (path.name + "-mtp-donor"), seed=seed + 7, **overrides)
    (file,) = path.glob("*.safetensors")
    _graft_qwen_mtp(file, next(donor.glob("*.safetensors")), "model.language_model.layers.3.", H, seed)
    return path
