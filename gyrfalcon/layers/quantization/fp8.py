"""How a linear layer holds FP8 weights, and the model-wide passes of loading them.

A quantized Linear keeps `weight` float8_e4m3fn [N, K] and `weight_scale_inv` fp32, a Parameter so the
checkpoint's `<module>.weight_scale_inv` tensors find it by name, with `quant_block` (bn, bk):
- checkpoint block scales (quantization_config weight_block_size, [128, 128]): weight_scale_inv
  [ceil(N / bn), ceil(K / bk)]; a fused MergedLinear / QKVLinear stacks its shards' scale rows the way it stacks
  their weight rows, so every shard but the last must be a multiple of bn rows (ValueError otherwise: a block
  would straddle two separately quantized projections).
- per-channel (`--quantization fp8` on an unquantized checkpoint): the weight loads in the model dtype and
  quantize_model_per_channel turns it into e4m3 with one scale per output row, weight_scale_inv [N, 1]
  (block (1, K)); the activations get one scale per token. The same kernel runs both (kernels/fp8_gemm).
  Quantizing after the load keeps one unquantized weight per layer's worth of memory in flight only through
  the load itself: the whole model is in the model dtype until the pass (fine for what fits unquantized).
Only Linear modules convert: embeddings, the LM head, norms and MoE routers have their own modules and stay
in the model dtype. A quantized Linear never takes the GEMV / folded-norm paths (layers/norm_linear.py): both
read a plain weight.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, List, Optional, Tuple

import torch
from torch import nn

from gyrfalcon.kernels.fp8_gemm import FP8_DTYPE, quantize_weight_per_channel

_SCOPE: List[Optional[Tuple[int, int]]] = [None]


@contextlib.contextmanager
def fp8_scope(block: Optional[Tuple[int, int]]):
    """Within this block every Linear built holds FP8 weights with `block` scales (None: unquantized)."""
    prev = _SCOPE[0]
    _SCOPE[0] = tuple(block) if block is not None else None
    try:
        yield
    finally:
        _SCOPE[0] = prev


def current_weight_block() -> Optional[Tuple[int, int]]:
    """The block shape new Linear modules quantize to (fp8_scope), or None."""
    return _SCOPE[0]


def is_quantized(linear) -> bool:
    return getattr(linear, "quant_block", None) is not None


def matches_module(name: str, patterns: Iterable[str]) -> bool:
    """Whether module `name` ("model.layers.0.mlp.gate_up_proj") is one of `patterns` (modules_to_not_convert):
    the name itself, a dotted suffix or prefix of it, or a dotted run inside it."""
    for p in patterns:
        p = p.strip(".")
        if p and (name == p or name.endswith("." + p) or name.startswith(p + ".") or f".{p}." in f".{name}."):
            return True
    return False


def init_fp8_params(linear, block: Tuple[int, int]) -> None:
    """Replace a freshly built Linear's weight with an empty e4m3 one and add its block scales."""
    bn, bk = block
    N, K = linear.out_features, linear.in_features
    dev = linear.weight.device
    linear.weight = nn.Parameter(torch.empty(N, K, dtype=FP8_DTYPE, device=dev), requires_grad=False)
    linear.weight_scale_inv = nn.Parameter(torch.empty(-(-N // bn), -(-K // bk), dtype=torch.float32, device=dev),
                                           requires_grad=False)
    linear.quant_block = (bn, bk)
    linear.small_m = False


def dequantize_params(linear, dtype: torch.dtype) -> None:
    """Undo init_fp8_params before loading (a module in modules_to_not_convert): an empty weight in `dtype`."""
    linear.weight = nn.Parameter(torch.empty(linear.out_features, linear.in_features, dtype=dtype,
                                             device=linear.weight.device), requires_grad=False)
    del linear.weight_scale_inv
    linear.quant_block = None


def check_shard_alignment(linear, shards) -> None:
    """A fused layer's shards: every one but the last a multiple of the block's rows (module docstring)."""
    bn = linear.quant_block[0]
    items = list(shards.items())
    for sid, (off, size) in items[:-1]:
        if size % bn:
            raise ValueError(
                f"FP8 block quantization: shard {sid!r} of a fused {type(linear).__name__} has {size} rows, not a "
                f"multiple of the {bn}-row weight block, so the separately quantized projections' scale blocks "
                "cannot stack; list the module in modules_to_not_convert or use a checkpoint with aligned shapes.")


def load_scale_shard(linear, param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
    """A shard's weight_scale_inv rows [ceil(size / bn), ceil(K / bk)] into the fused scales (offsets in blocks)."""
    bn = linear.quant_block[0]
    off, size = linear.shards[shard_id]
    dst = param.data.narrow(0, off // bn, -(-size // bn))
    if dst.shape != loaded.shape:
        raise ValueError(f"Shape mismatch for the weight_scale_inv of shard {shard_id!r}: {tuple(dst.shape)} vs "
                         f"checkpoint {tuple(loaded.shape)}.")
    dst.copy_(loaded)


def check_weight_dtype(linear, param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param is linear.weight and is_quantized(linear) and loaded.dtype != param.dtype:
        raise ValueError(f"Checkpoint weight of dtype {loaded.dtype} for an FP8 linear layer: the quantization_config "
                         "says fp8; list the module in modules_to_not_convert if it ships unquantized.")


def prepare_model(model: nn.Module, modules_to_not_convert: Iterable[str], dtype: torch.dtype) -> int:
    """After building under fp8_scope: the Linear modules named in modules_to_not_convert go back to `dtype`; the
    fused ones are matched by their checkpoint names too (model.stacked_params: qkv_proj as q_proj, ...), all or
    none of their shards. Returns how many Linear modules stay quantized."""
    from gyrfalcon.layers.linear import Linear

    skip = list(modules_to_not_convert)
    stacked = getattr(model, "stacked_params", ())
    n = 0
    for name, m in model.named_modules():
        if not isinstance(m, Linear) or not is_quantized(m):
            continue
        names = [name] + [name.replace(fused, ckpt) for ckpt, fused, _ in stacked if fused in name]
        hits = [matches_module(x, skip) for x in names]
        if hits[0] or (len(hits) > 1 and all(hits[1:])):
            dequantize_params(m, dtype)
        elif any(hits[1:]):
            raise ValueError(f"modules_to_not_convert lists some but not all projections fused into {name}.")
        else:
            n += 1
    return n


def quantize_linear_per_channel(linear) -> None:
    """A loaded Linear's weight -> e4m3 with one scale per output row (block (1, K))."""
    q, s = quantize_weight_per_channel(linear.weight.data)
    linear.weight = nn.Parameter(q, requires_grad=False)
    linear.weight_scale_inv = nn.Parameter(s, requires_grad=False)
    linear.quant_block = (1, linear.in_features)
    linear.small_m = False


def quantize_model_per_channel(model: nn.Module, modules_to_not_convert: Iterable[str] = ()) -> int:
    """`--quantization fp8`: every unquantized Linear of the loaded model (not the embeddings, LM head, norms or
    routers: not Linear modules) to per-channel e4m3, except those in modules_to_not_convert. Returns how many."""
    from gyrfalcon.layers.linear import Linear

    skip = list(modules_to_not_convert)
    n = 0
    for name, m in model.named_modules():
        if isinstance(m, Linear) and not is_quantized(m) and not matches_module(name, skip):
            quantize_linear_per_channel(m)
            n += 1
    return n
