"""Build a model from a checkpoint directory, streaming safetensors tensor by tensor.

FP8 (model_config.quant_config, config.py QuantizationConfig): a block-quantized checkpoint builds its Linear
modules with e4m3 weights (layers/quantization fp8_scope; modules_to_not_convert back to the model dtype), and its
`<linear>.weight_scale_inv` tensors are routed here to the Linear's weight_loader (fused shards by the model's
stacked_params, as load_weights maps weights); `--quantization fp8` quantizes the loaded Linear weights per output
channel. Either way before fold_norms, which leaves quantized linear layers alone."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterable, Iterator, Set, Tuple

import torch
from safetensors import safe_open

from gyrfalcon.layers.linear import Linear
from gyrfalcon.layers.norm_linear import fold_norms
from gyrfalcon.layers.quantization import fp8_scope, prepare_model, quantize_model_per_channel
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


def route_scales(model: torch.nn.Module, weights: Iterable[Tuple[str, torch.Tensor]],
                 loaded: Set[str]) -> Iterator[Tuple[str, torch.Tensor]]:
    """Pass `weights` through, except the `.weight_scale_inv` tensors of Linear modules: those go to the Linear's
    weight_loader here (a fused one's shard found through model.stacked_params) and their names (name#shard for a
    shard) into `loaded`. Other scale tensors (MoE experts') pass through to the model's load_weights."""
    params = dict(model.named_parameters(remove_duplicate=False))
    stacked = getattr(model, "stacked_params", ())
    for name, tensor in weights:
        if not name.endswith(".weight_scale_inv"):
            yield name, tensor
            continue
        target, shard = name, None
        for ckpt, fused, sid in stacked:
            if ckpt in name:
                target, shard = name.replace(ckpt, fused), sid
                break
        owner_name = target.rsplit(".", 1)[0]
        param = params.get(target)
        owner = model.get_submodule(owner_name) if param is not None else None
        if not isinstance(owner, Linear):
            yield name, tensor
            continue
        owner.weight_loader(param, tensor, shard)
        loaded.add(target if shard is None else f"{target}#{shard}")


def load_model(model_config, device: str) -> torch.nn.Module:
    """The model of `model_config` on `device` in its dtype, every parameter filled from disk."""
    cls = resolve_model_class(model_config.hf_config)
    quant = getattr(model_config, "quant_config", None)
    block = quant.weight_block_size if quant is not None and quant.from_checkpoint else None
    with _default_dtype(model_config.torch_dtype), torch.device(device), fp8_scope(block):
        model = cls(model_config.hf_config, max_position=model_config.max_model_len)
    if block is not None:
        prepare_model(model, quant.modules_to_not_convert, model_config.torch_dtype)
    scales: Set[str] = set()
    loaded = model.load_weights(route_scales(model, iterate_safetensors(model_config.model), scales))
    missing = model.expected_weights() - loaded - scales
    if missing:
        raise ValueError(f"Checkpoint {model_config.model} lacks weights: {sorted(missing)[:10]}"
                         f"{' ...' if len(missing) > 10 else ''}")
    if quant is not None and not quant.from_checkpoint:
        quantize_model_per_channel(model, quant.modules_to_not_convert)
    fold_norms(model)  # needs every tensor in place: each norm's weight goes into the GEMM after it
    return model.eval()
