"""Build a model from a checkpoint directory, streaming safetensors tensor by tensor."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator, Tuple

import torch
from safetensors import safe_open

from gyrfalcon.layers.norm_linear import fold_norms
from gyrfalcon.models.registry import resolve_model_class


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


def iterate_safetensors(model_dir: str) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every *.safetensors file, one tensor in memory at a time."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"No *.safetensors weight files in {model_dir}.")
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in sf.keys():
                yield name, sf.get_tensor(name)


def load_model(model_config, device: str) -> torch.nn.Module:
    """The model of `model_config` on `device` in its dtype, every parameter filled from disk."""
    cls = resolve_model_class(model_config.hf_config)
    with _default_dtype(model_config.torch_dtype), torch.device(device):
        model = cls(model_config.hf_config, max_position=model_config.max_model_len)
    loaded = model.load_weights(iterate_safetensors(model_config.model))
    missing = model.expected_weights() - loaded
    if missing:
        raise ValueError(f"Checkpoint {model_config.model} lacks weights: {sorted(missing)[:10]}"
                         f"{' ...' if len(missing) > 10 else ''}")
    fold_norms(model)  # needs every tensor in place: each norm's weight goes into the GEMM after it
    return model.eval()
