"""Build a model from a checkpoint directory, streaming safetensors tensor by tensor.

FP8 (model_config.quant_config, config.py QuantizationConfig): a block-quantized checkpoint builds its Linear
modules with e4m3 weights (layers/quantization fp8_scope; modules_to_not_convert back to the model dtype), and its
`<linear>.weight_scale_inv` tensors are routed here to the Linear's weight_loader (fused shards by the model's
stacked_params, as load_weights maps weights); `--quantization fp8` quantizes the loaded Linear weights per output
channel. Either way before fold_norms, which leaves quantized linear layers alone.

load_format "dummy" (config.py LOAD_FORMATS) reads no weight file: fill_dummy_weights gives every parameter random
values of a sane scale on the device, then the same post-load passes run (quantize_model_per_channel, fold_norms)."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path
from typing import Dict, Iterable, Iterator, Set, Tuple

import torch
from safetensors import safe_open

from gyrfalcon.distributed import CheckpointSlice, tp_size
from gyrfalcon.kernels.fp8_gemm import FP8_DTYPE, FP8_MAX
from gyrfalcon.layers.linear import Linear
from gyrfalcon.layers.norm_linear import fold_norms
from gyrfalcon.layers.quantization import fp8_scope, prepare_model, quantize_model_per_channel
from gyrfalcon.models.gguf_loader import gguf_file_description, is_gguf, iterate_gguf
from gyrfalcon.models.registry import resolve_model_class

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


def iterate_safetensors(model_dir: str, lazy: bool = False) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every *.safetensors file, one tensor in memory at a time. lazy (tensor
    parallelism): (name, CheckpointSlice), read by the consumer, only its rank's part where it narrows it."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"No *.safetensors weight files in {model_dir}.")
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in sf.keys():
                yield name, (CheckpointSlice(sf.get_slice(name)) if lazy else sf.get_tensor(name))


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


# Dummy weights. Matrices get N(0, 1 / fan_in) with fan_in the last dim (Linear [N, K], experts w13 [E, 2I, H] /
# w2 [E, H, I], router [E, H], LM head [V, H], conv [C, 1, width]): each product keeps the scale of its normed
# input, so at every width a block adds O(1) to the residual stream and, the norms being pre-norms, the stream
# grows like sqrt(layers) (about 8x over 62 layers) instead of compounding; logits come out O(1). A fixed 0.02
# is the same at hidden 2500 but shrinks every block's output to ~0.16 at the test configs' hidden 64.
DUMMY_EMBED_STD = 0.02  # embeddings (transformers' initializer_range): the first norm rescales them anyway
DUMMY_NORM_NOISE = 0.1  # norm weights 1 + N(0, 0.1^2): not all ones, so a norm that is skipped changes the output
DUMMY_BIAS_STD = 0.02
DUMMY_SCORE_BIAS_STD = 0.01  # e_score_correction_bias (fp32): only breaks near-ties in the expert choice
# FP8 codes ~ N(0, 64^2): the largest e4m3 value (448) is 7 sigma away, so the clamp almost never bites and
# every code keeps e4m3's 3 mantissa bits; scale_inv = std / 64 gives the dequantized weight the std above.
_FP8_CODE_STD = 64.0
_CHUNK = 1 << 26  # elements per temporary of the FP8 fill (256 MB in fp32) next to a model that fills the device


def _leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _fill_fp8(p: torch.Tensor, g: torch.Generator) -> None:
    flat = p.data.view(-1)
    for i in range(0, flat.numel(), _CHUNK):
        n = min(_CHUNK, flat.numel() - i)
        codes = torch.randn(n, generator=g, device=p.device, dtype=torch.float32).mul_(_FP8_CODE_STD)
        flat[i:i + n].copy_(codes.clamp_(-FP8_MAX, FP8_MAX))


def _fill_one(name: str, p: torch.Tensor, g: torch.Generator) -> float:
    """Fill parameter `name` in place by what its name and shape say it is; returns the std of the (dequantized)
    weight, which a matrix's FP8 scales need."""
    leaf = _leaf(name)
    if leaf == "A_log":  # linear attention's decay rates A = exp(A_log) in [1, 16] (Mamba-2 / Gated DeltaNet init)
        p.data.uniform_(1.0, 16.0, generator=g).log_()
        return 0.0
    if leaf == "dt_bias":  # softplus(dt_bias) = a step dt log-uniform in [1e-3, 1e-1] (Mamba's inverse softplus)
        dt = torch.empty(p.shape, device=p.device, dtype=torch.float32)
        dt.uniform_(math.log(1e-3), math.log(1e-1), generator=g).exp_()
        p.data.copy_(dt + torch.log(-torch.expm1(-dt)))
        return 0.0
    if leaf == "e_score_correction_bias":
        p.data.normal_(0.0, DUMMY_SCORE_BIAS_STD, generator=g)
        return DUMMY_SCORE_BIAS_STD
    if p.dim() == 1:
        if "norm" in name and leaf == "weight":
            p.data.normal_(1.0, DUMMY_NORM_NOISE, generator=g)
            return DUMMY_NORM_NOISE
        p.data.normal_(0.0, DUMMY_BIAS_STD, generator=g)
        return DUMMY_BIAS_STD
    std = DUMMY_EMBED_STD if "embed" in name else p.shape[-1] ** -0.5
    if p.dtype == FP8_DTYPE:
        _fill_fp8(p, g)
    else:
        p.data.normal_(0.0, std, generator=g)
    return std


@torch.no_grad()
def fill_dummy_weights(model: torch.nn.Module, seed: int = 0) -> Tuple[int, int]:
    """load_format dummy: every parameter of `model` random on its own device, from one generator seeded by
    `seed` (the same model and seed give the same weights). Found generically (named_parameters, by name and
    dtype) so that any family's parameters get sane values: matrices N(0, 1 / fan_in) (the DUMMY_* notes), FP8
    (e4m3) ones as codes whose `<name>_scale_inv` (a Linear's weight_scale_inv [ceil(N / 128), ceil(K / 128)],
    FusedExperts' w13_scale_inv [E, ...]) dequantizes them to that std; norm weights 1 + noise; biases, the
    router's e_score_correction_bias, A_log and dt_bias their own ranges. A tied LM head is the embedding,
    filled once. Returns (parameter tensors, bytes)."""
    params: Dict[str, torch.nn.Parameter] = dict(model.named_parameters())
    if not params:
        return 0, 0
    g = torch.Generator(device=next(iter(params.values())).device).manual_seed(seed)
    stds: Dict[str, float] = {}
    for name, p in params.items():
        if not name.endswith("scale_inv"):  # scales after their weights: they depend on the weight's std
            stds[name] = _fill_one(name, p, g)
    for name, p in params.items():
        if name.endswith("scale_inv"):
            weight = name[:-len("_scale_inv")]
            if weight not in stds:
                raise ValueError(f"Dummy weights: scale {name} has no weight {weight} to scale.")
            p.data.fill_(stds[weight] / _FP8_CODE_STD)
    return len(params), sum(p.numel() * p.element_size() for p in params.values())


def _load_dummy(model: torch.nn.Module, seed: int, device: str) -> None:
    t0 = time.perf_counter()
    n, nbytes = fill_dummy_weights(model, seed)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    logger.info("dummy weights: %d parameters (%.2f GB) filled in %.2f s", n, nbytes / 1e9, time.perf_counter() - t0)


def check_tensor_parallel(cls, tp: int) -> None:
    """Under tensor parallelism (gyrfalcon/distributed: the worker set the group up before loading) every layer
    builds this rank's shard and each weight_loader narrows the checkpoint tensor it gets to that shard. Refuse
    what does not shard yet, before building anything (the engine asks before it starts workers: executor.py). FP8
    weights shard with their block scales (layers/quantization/fp8.py: shards of whole blocks, refused otherwise
    when the model is built)."""
    if tp == 1:
        return
    if not getattr(cls, "supports_tensor_parallel", False):
        raise ValueError(f"{cls.__name__} does not support tensor parallelism yet (tensor_parallel_size={tp}); "
                         "docs/parallelism.md lists the families that do.")


def load_model(model_config, device: str) -> torch.nn.Module:
    """The model of `model_config` on `device` in its dtype, every parameter filled from disk (or, with
    load_format "dummy", with random values: fill_dummy_weights)."""
    cls = resolve_model_class(model_config.hf_config)
    quant = getattr(model_config, "quant_config", None)
    block = quant.weight_block_size if quant is not None and quant.from_checkpoint else None
    check_tensor_parallel(cls, tp_size())
    with _default_dtype(model_config.torch_dtype), torch.device(device), fp8_scope(block):
        model = cls(model_config.hf_config, max_position=model_config.max_model_len)
    if block is not None:
        prepare_model(model, quant.modules_to_not_convert, model_config.torch_dtype)
    if getattr(model_config, "load_format", "auto") == "dummy":
        _load_dummy(model, model_config.seed, device)
    else:
        scales: Set[str] = set()
        gguf, t0 = is_gguf(model_config.model), time.perf_counter()
        # A GGUF file: every tensor dequantized as it is read (models/gguf_loader.py), under the HF names.
        weights = (iterate_gguf(model_config.model, model_config.hf_config) if gguf
                   else iterate_safetensors(model_config.model, lazy=tp_size() > 1))
        loaded = model.load_weights(route_scales(model, weights, scales))
        if gguf:
            logger.info("GGUF %s dequantized in %.2f s", gguf_file_description(model_config.model),
                        time.perf_counter() - t0)
        missing = model.expected_weights() - loaded - scales
        if missing:
            raise ValueError(f"Checkpoint {model_config.model} lacks weights: {sorted(missing)[:10]}"
                             f"{' ...' if len(missing) > 10 else ''}")
    if quant is not None and not quant.from_checkpoint:
        quantize_model_per_channel(model, quant.modules_to_not_convert)
    fold_norms(model)  # needs every tensor in place: each norm's weight goes into the GEMM after it
    return model.eval()
