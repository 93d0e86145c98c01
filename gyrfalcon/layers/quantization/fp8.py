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
Tensor parallelism (gyrfalcon/distributed): a sharded layer's checkpoint scales narrow with its weight, to the
blocks of the rank's rows (column-parallel, each projection of a fused layer) or columns (row-parallel), and an
expert's to the rank's slice of its intermediate rows; so each shard must be a whole number of blocks
(check_tp_shards, check_expert_alignment: refused, naming the layer, before anything loads). Per-channel scales
are computed after the load from the rank's own shard and need nothing.
Linear modules and the MoE experts (layers/moe.py FusedExperts) convert: embeddings, the LM head, norms and MoE
routers have their own modules and stay in the model dtype. A quantized Linear never takes the GEMV / folded-norm
paths (layers/norm_linear.py): both read a plain weight.

FusedExperts (w13 [E, 2I, H], w2 [E, H, I]) hold e4m3 weights with block scales in both modes, so one fused-MoE
kernel mode serves both (kernels/fused_moe's FP8 mode):
- checkpoint: w13_weight_scale_inv [E, ceil(2I / bn), ceil(H / bk)] and w2_weight_scale_inv [E, ceil(H / bn),
  ceil(I / bk)], one grid per expert; the checkpoint quantized gate_proj and up_proj apart, so their scale rows
  stack like their weight rows only when I % bn == 0 (prepare_model checks, naming the layer).
- `--quantization fp8`: each expert's stacked w13 and its w2 quantized here with (128, 128) blocks over the whole
  stacked matrix (quantize_experts_blockwise: no alignment needed), not per channel: the grouped GEMMs step K by
  the block width, one activation scale per row a step.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, List, Optional, Tuple

import torch
from torch import nn

from gyrfalcon.distributed import as_tensor, tp_rank, tp_size
from gyrfalcon.kernels.fp8_gemm import FP8_DTYPE, quantize_weight_blockwise, quantize_weight_per_channel

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


def is_quantized(module) -> bool:
    """A quantized Linear or FusedExperts (quant_block set)."""
    return getattr(module, "quant_block", None) is not None


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


def check_tp_shards(linear, name: str = "") -> None:
    """Under tensor parallelism a checkpoint-quantized Linear's shard must start and end on the scales' block grid:
    a ColumnParallelLinear's output rows and each sharded projection of a MergedLinear a multiple of bn, a
    RowParallelLinear's input columns a multiple of bk (else one of the rank's blocks would hold parts of two
    checkpoint blocks under two scales). ValueError naming the layer otherwise."""
    if tp_size() == 1 or linear.quant_block is None or linear.quant_block[0] == 1:  # (per-channel: any split)
        return
    from gyrfalcon.layers.linear import MergedLinear

    bn, bk = linear.quant_block
    where = f" {name}" if name else ""
    if isinstance(linear, MergedLinear) and type(linear)._rank_slice is not MergedLinear._rank_slice:
        # (a shard gathered from several blocks of its checkpoint tensor, e.g. Qwen3.5's flat in_proj_qkv: its
        # scales would need the same gathering, which load_scale_shard does not do)
        raise ValueError(f"FP8 block quantization with tensor_parallel_size {tp_size()}: {type(linear).__name__}"
                         f"{where} takes its shard from several parts of the checkpoint tensor, whose block scales "
                         "do not shard yet; list it in modules_to_not_convert or use tensor_parallel_size 1.")
    parts = []
    if hasattr(linear, "tp_slices"):  # MergedLinear / QKVLinear: each projection split (not replicated whole)
        parts = [(f"projection {sid!r}'s rows", linear.shards[sid][1], bn)
                 for sid, (_, full) in linear.tp_slices.items() if linear.shards[sid][1] != full]
    elif hasattr(linear, "full_out_features"):  # ColumnParallelLinear
        parts = [("output rows", linear.out_features, bn)]
    elif hasattr(linear, "full_in_features"):  # RowParallelLinear
        parts = [("input columns", linear.in_features, bk)]
    for what, n, block in parts:
        if n % block:
            raise ValueError(
                f"FP8 block quantization with tensor_parallel_size {tp_size()}: each rank's shard of the "
                f"{what} of {type(linear).__name__}{where} is {n}, not a multiple of the {block}-wide scale "
                "block, so the checkpoint's block scales cannot be split between the ranks; choose a "
                "tensor_parallel_size whose shards are whole blocks (or expert parallelism for MoE experts).")


def narrow_scales(linear, loaded, dim: int, full: int):
    """This rank's blocks along `dim` (0: rows, 1: columns) of a sharded layer's checkpoint scales, `full` rows
    or columns of weight in all (check_tp_shards made the shard a whole number of blocks)."""
    block = linear.quant_block[dim]
    n = linear.weight.shape[dim] // block
    if loaded.shape[dim] != -(-full // block):
        raise ValueError(f"Shape mismatch: weight_scale_inv of {-(-full // block)} blocks along dim {dim} expected, "
                         f"checkpoint {tuple(loaded.shape)}.")
    return loaded.narrow(dim, tp_rank() * n, n)


def load_scale_shard(linear, param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
    """A shard's weight_scale_inv rows [ceil(size / bn), ceil(K / bk)] into the fused scales (offsets in blocks);
    under tensor parallelism the rank's block rows of the checkpoint's (the slice MergedLinear._rank_slice takes of
    the weight)."""
    bn = linear.quant_block[0]
    off, size = linear.shards[shard_id]
    index, full = linear.tp_slices[shard_id]
    if size != full:
        if loaded.shape[0] != -(-full // bn):
            raise ValueError(f"Shape mismatch for the weight_scale_inv of shard {shard_id!r}: {-(-full // bn)} "
                             f"block rows expected, checkpoint {tuple(loaded.shape)}.")
        loaded = loaded.narrow(0, index * (size // bn), size // bn)
    loaded = as_tensor(loaded)
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
    none of their shards. MoE experts likewise (prepare_experts); those that stay quantized must have
    checkpoint-aligned halves (check_expert_alignment). Returns how many modules (Linear and FusedExperts) stay
    quantized."""
    from gyrfalcon.layers.linear import Linear
    from gyrfalcon.layers.moe import FusedExperts

    skip = list(modules_to_not_convert)
    stacked = getattr(model, "stacked_params", ())
    n = 0
    for name, m in model.named_modules():
        if isinstance(m, FusedExperts) and is_quantized(m):
            n += prepare_experts(model, name, m, skip, dtype)
            continue
        if not isinstance(m, Linear) or not is_quantized(m):
            continue
        names = [name] + [name.replace(fused, ckpt) for ckpt, fused, _ in stacked if fused in name]
        hits = [matches_module(x, skip) for x in names]
        if hits[0] or (len(hits) > 1 and all(hits[1:])):
            dequantize_params(m, dtype)
        elif any(hits[1:]):
            raise ValueError(f"modules_to_not_convert lists some but not all projections fused into {name}.")
        else:
            check_tp_shards(m, name)
            n += 1
    return n


# Checkpoint spellings of an MoE block's MLP slot besides gyrfalcon's `mlp` (MiniMax-M2 / Mixtral:
# `model.layers.N.block_sparse_moe.experts...`): modules_to_not_convert may name the experts by them.
MLP_SLOT_ALIASES = ("block_sparse_moe",)


def expert_module_names(model: nn.Module, name: str, experts) -> Tuple[List[str], List[List[str]]]:
    """The names modules_to_not_convert may give the experts module `name`, in gyrfalcon's and the checkpoint's
    spelling of the MLP slot: (the module's own, e.g. model.layers.3.mlp.experts and
    model.layers.3.block_sparse_moe.experts; per spelling, its per-expert projections, e.g.
    model.layers.3.mlp.experts.7.gate_proj for model.expert_params' projection names)."""
    whole = [name] + [name.replace(".mlp.", f".{a}.") for a in MLP_SLOT_ALIASES if ".mlp." in name]
    projs = [proj for proj, _, _ in getattr(model, "expert_params", ())]
    per = [[f"{w}.{e}.{p}" for e in range(experts.num_experts) for p in projs] for w in whole] if projs else []
    return whole, per


def experts_not_converted(model: nn.Module, name: str, experts, skip: List[str]) -> bool:
    """Whether modules_to_not_convert names the FusedExperts `name`: an `experts`, `mlp` or `block_sparse_moe`
    pattern, a layer prefix, or every one of its per-expert projections; ValueError when it names only some
    experts' projections (they share one stacked weight, quantized or not as a whole)."""
    whole, per = expert_module_names(model, name, experts)
    if any(matches_module(x, skip) for x in whole):
        return True
    hits = [[matches_module(x, skip) for x in names] for names in per]
    if any(all(h) for h in hits):
        return True
    if any(any(h) for h in hits):
        raise ValueError(f"modules_to_not_convert lists some but not all expert projections of {name}: its experts "
                         "are one stacked weight, quantized or not as a whole.")
    return False


def prepare_experts(model: nn.Module, name: str, experts, skip: List[str], dtype: torch.dtype) -> int:
    """One FusedExperts built under fp8_scope: back to `dtype` when modules_to_not_convert names it, else checked
    for checkpoint-aligned halves. Returns 1 if it stays quantized."""
    if experts_not_converted(model, name, experts, skip):
        dequantize_experts(experts, dtype)
        return 0
    check_expert_alignment(experts, name)
    return 1


def init_fp8_experts(experts, block: Tuple[int, int]) -> None:
    """A freshly built FusedExperts: empty e4m3 w13 [E, 2I, H] / w2 [E, H, I] and their block scales
    w13_weight_scale_inv [E, ceil(2I / bn), ceil(H / bk)], w2_weight_scale_inv [E, ceil(H / bn), ceil(I / bk)]."""
    bn, bk = block
    E, two_i, H = experts.w13.shape
    inter = two_i // 2
    dev = experts.w13.device
    experts.w13 = nn.Parameter(torch.empty(E, two_i, H, dtype=FP8_DTYPE, device=dev), requires_grad=False)
    experts.w2 = nn.Parameter(torch.empty(E, H, inter, dtype=FP8_DTYPE, device=dev), requires_grad=False)
    experts.w13_weight_scale_inv = nn.Parameter(
        torch.empty(E, -(-two_i // bn), -(-H // bk), dtype=torch.float32, device=dev), requires_grad=False)
    experts.w2_weight_scale_inv = nn.Parameter(
        torch.empty(E, -(-H // bn), -(-inter // bk), dtype=torch.float32, device=dev), requires_grad=False)
    experts.quant_block = (bn, bk)


def dequantize_experts(experts, dtype: torch.dtype) -> None:
    """Undo init_fp8_experts before loading (experts in modules_to_not_convert): empty weights in `dtype`."""
    experts.w13 = nn.Parameter(torch.empty(experts.w13.shape, dtype=dtype, device=experts.w13.device),
                               requires_grad=False)
    experts.w2 = nn.Parameter(torch.empty(experts.w2.shape, dtype=dtype, device=experts.w2.device),
                              requires_grad=False)
    del experts.w13_weight_scale_inv, experts.w2_weight_scale_inv
    experts.quant_block = None


def check_expert_alignment(experts, name: str = "") -> None:
    """Checkpoint FP8 experts: gate_proj and up_proj were quantized apart, each with its own
    [ceil(I / bn), ceil(H / bk)] scales; stacked into w13 they stay per-block exact only when I is a multiple
    of bn (else one block of w13 rows would hold gate rows and up rows under two different scales)."""
    bn, bk = experts.quant_block
    inter = experts.intermediate_size
    where = f" {name}" if name else ""
    if inter != experts.full_intermediate_size and inter % bk:  # each rank's slice of every expert (tensor parallel)
        raise ValueError(
            f"FP8 block quantization with tensor_parallel_size {tp_size()}: each rank's slice of the MoE experts"
            f"{where} is {inter} of their {experts.full_intermediate_size} intermediate rows, not a multiple of the "
            f"{bk}-wide scale block, so the checkpoint's block scales cannot be split between the ranks; use expert "
            "parallelism (--enable-expert-parallel: each rank holds whole experts) or a smaller "
            "tensor_parallel_size.")
    if inter % bn:
        raise ValueError(
            f"FP8 block quantization: the MoE experts{where} have intermediate size {inter}, not a multiple of the "
            f"{bn}-row weight block, so each expert's separately quantized gate_proj and up_proj scale blocks "
            "cannot stack into w13; list the experts in modules_to_not_convert (and ship them unquantized) or use "
            "a checkpoint with aligned shapes.")


def load_expert_scale(experts, param: nn.Parameter, loaded: torch.Tensor, expert: int, half) -> None:
    """One checkpoint projection's weight_scale_inv into the stacked scales: half 0 / 1 (gate / up) the
    [I / bn, ceil(H / bk)] rows at block row half * I / bn of w13_weight_scale_inv[expert]; None the whole
    w2_weight_scale_inv[expert] [ceil(H / bn), ceil(I / bk)]. expert: the local index (FusedExperts.weight_loader
    has subtracted expert_start and skipped other ranks' experts under expert parallelism)."""
    dst = param.data[expert]
    bn, bk = experts.quant_block
    inter, full = experts.intermediate_size, experts.full_intermediate_size
    if half is not None:
        check_expert_alignment(experts)
        rows = inter // bn
        dst = dst.narrow(0, half * rows, rows)
        if inter != full and loaded.shape[0] == full // bn:  # this rank's slice of each expert: its block rows
            loaded = loaded.narrow(0, tp_rank() * rows, rows)
    elif inter != full and loaded.dim() == 2 and loaded.shape[1] == -(-full // bk):  # w2: its block columns
        loaded = loaded.narrow(1, tp_rank() * (inter // bk), inter // bk)
    if dst.shape != loaded.shape:
        raise ValueError(f"Shape mismatch for the weight_scale_inv of expert {expert} shard {half}: "
                         f"{tuple(dst.shape)} vs checkpoint {tuple(loaded.shape)}.")
    dst.copy_(loaded)


def quantize_experts_blockwise(experts, block: Tuple[int, int] = (128, 128)) -> None:
    """`--quantization fp8` for loaded FusedExperts: each expert's stacked w13 [2I, H] and w2 [H, I] to e4m3 with
    `block` scales over the whole matrix (so the gate / up boundary need not fall on a block edge), one expert at a
    time (one expert's fp32 copy in flight)."""
    E = experts.num_experts
    dev = experts.w13.device
    for pname in ("w13", "w2"):
        w = getattr(experts, pname).data
        q = torch.empty(w.shape, dtype=FP8_DTYPE, device=dev)
        scales = []
        for e in range(E):
            qe, se = quantize_weight_blockwise(w[e], block)
            q[e].copy_(qe)
            scales.append(se)
        setattr(experts, pname, nn.Parameter(q, requires_grad=False))
        setattr(experts, f"{pname}_weight_scale_inv", nn.Parameter(torch.stack(scales), requires_grad=False))
    experts.quant_block = tuple(block)


def quantize_linear_per_channel(linear) -> None:
    """A loaded Linear's weight -> e4m3 with one scale per output row (block (1, K))."""
    q, s = quantize_weight_per_channel(linear.weight.data)
    linear.weight = nn.Parameter(q, requires_grad=False)
    linear.weight_scale_inv = nn.Parameter(s, requires_grad=False)
    linear.quant_block = (1, linear.in_features)
    linear.small_m = False


# `--quantization fp8`'s block for MoE experts (the checkpoints' own: DeepSeek-V3, Qwen3-FP8, MiniMax-M2).
ONLINE_EXPERT_BLOCK = (128, 128)


def quantize_model_per_channel(model: nn.Module, modules_to_not_convert: Iterable[str] = ()) -> int:
    """`--quantization fp8`: every unquantized Linear of the loaded model (not the embeddings, LM head, norms or
    routers: not Linear modules) to per-channel e4m3, and every unquantized FusedExperts to 128 x 128 block e4m3
    (quantize_experts_blockwise), except those in modules_to_not_convert. Returns how many modules."""
    from gyrfalcon.layers.linear import Linear
    from gyrfalcon.layers.moe import FusedExperts

    skip = list(modules_to_not_convert)
    n = 0
    for name, m in model.named_modules():
        if isinstance(m, Linear) and not is_quantized(m) and not matches_module(name, skip):
            quantize_linear_per_channel(m)
            n += 1
        elif isinstance(m, FusedExperts) and not is_quantized(m) and not experts_not_converted(model, name, m, skip):
            quantize_experts_blockwise(m, ONLINE_EXPERT_BLOCK)
            n += 1
    return n
