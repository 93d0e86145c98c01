"""Linear layers, including the fused projections filled from separate checkpoint tensors.

A checkpoint stores q_proj, k_proj and v_proj (and gate_proj, up_proj) apart; gyrfalcon keeps each
group in one weight so one GEMM does the work. `weight_loader(param, tensor, shard_id)` copies a
checkpoint tensor into its rows of the fused weight.

FP8 (layers/quantization/fp8.py): a Linear built inside fp8_scope(block) holds a float8_e4m3fn weight and a
`weight_scale_inv` Parameter (quant_block set) and runs through kernels/fp8_gemm; a fused layer's scale shards
land at row offsets in blocks. quant_block None: the plain weight in the model dtype.

Tensor parallelism (gyrfalcon/distributed): the fused MergedLinear / QKVLinear are column-parallel (each rank holds
its rows of every shard: its heads, its slice of the intermediate dim) and RowParallelLinear takes the matching
input slice and all-reduces its partial products. Each weight_loader narrows the checkpoint tensor to the rank's
slice, so the same loading code runs at every world size (at 1 the slice is the whole tensor). An FP8 weight's
block scales narrow alike, to the blocks of the rank's rows or columns: a shard must start and end on the block
grid (a multiple of 128 rows or columns; refused before loading otherwise: layers/quantization/fp8.py check_tp_shards).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from gyrfalcon import envs
from gyrfalcon.distributed import as_tensor, shard_size, tp_all_reduce, tp_collectives, tp_rank, tp_size
from gyrfalcon.kernels.common import use_triton
from gyrfalcon.kernels.fp8_gemm import fp8_block_gemm
from gyrfalcon.kernels.gemv import linear_gemv_rows, norm_gemv_triton
from gyrfalcon.layers.quantization import fp8 as _fp8


class Linear(nn.Module):
    """y = x @ W^T (+ b). W: [out_features, in_features]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        # Decode-sized inputs on the GPU go through gyrfalcon's GEMV: cuBLAS picks slow launch shapes for a few
        # rows against a small weight (kernels/small_m_gemv.py). How many rows depends on the shape
        # (linear_gemv_rows); the unfused reference path (GYRFALCON_DISABLE_FUSION=1) keeps cuBLAS.
        self.small_m = not envs.get().disable_fusion and not bias
        self.small_m_rows = linear_gemv_rows(out_features, in_features, merged=False)
        self.quant_block: Optional[Tuple[int, int]] = None  # (bn, bk) when the weight is FP8
        block = _fp8.current_weight_block()
        if block is not None:
            _fp8.init_fp8_params(self, block)

    def forward(self, x: torch.Tensor, add_to: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x: [num_tokens, in_features] -> [num_tokens, out_features]. add_to [num_tokens, out_features]: the
        product is added to it in place and add_to returned (the residual add inside the GEMM: cuBLAS's
        beta = 1, or the GEMV's epilogue; folded norms, layers/norm_linear.py)."""
        if self.quant_block is not None:
            y = self._fp8_product(x)
            if self.bias is not None:
                y = y + self.bias
            return y if add_to is None else add_to.add_(y)
        if self.small_m and x.shape[0] <= self.small_m_rows and x.dim() == 2 and x.stride(-1) == 1 and use_triton(x):
            return norm_gemv_triton(x, self.weight, add_to=add_to)[0]
        if add_to is None:
            return F.linear(x, self.weight, self.bias)
        if self.bias is not None:
            return add_to.add_(F.linear(x, self.weight, self.bias))
        return add_to.addmm_(x, self.weight.t())

    def _fp8_product(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T of the FP8 weight, without the bias."""
        y = fp8_block_gemm(x.reshape(-1, x.shape[-1]), self.weight, self.weight_scale_inv, self.quant_block)
        return y.view(*x.shape[:-1], self.out_features)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _fp8.check_weight_dtype(self, param, loaded)
        loaded = as_tensor(loaded)  # (a CheckpointSlice under tensor parallelism: read whole, replicated)
        if param.shape != loaded.shape:
            raise ValueError(f"Shape mismatch: parameter {tuple(param.shape)} vs checkpoint "
                             f"{tuple(loaded.shape)}.")
        param.data.copy_(loaded)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim (gate_up, qkv), column-parallel.

    shard_sizes: each shard's rows in the checkpoint (the whole model's). `shards` maps a shard id to (row
    offset, rows) in this rank's fused weight; `tp_slices` to (which slice of the checkpoint tensor this rank
    loads, the checkpoint tensor's rows). By default a shard splits into tp_size() equal slices, rank r loading
    slice r; QKVLinear replicates K/V heads when there are fewer than ranks (tp_layout).
    """

    def __init__(self, in_features: int, shard_sizes: Dict[object, int], bias: bool = False,
                 tp_layout: Optional[Dict[object, Tuple[int, int]]] = None) -> None:
        """tp_layout: {shard id: (rows this rank holds, slice index)}; None: the even split."""
        if tp_layout is None:
            tp_layout = {sid: (shard_size(size, f"the rows of projection {sid!r}"), tp_rank())
                         for sid, size in shard_sizes.items()}
        super().__init__(in_features, sum(rows for rows, _ in tp_layout.values()), bias)
        # qkv and gate_up of 2-16 rows stay with cuBLAS, unless their shape has a launch shape of its own
        # (small_m_gemv.ROWS_SHAPES); single rows take the GEMV with the norm fused (layers/norm_linear.py).
        self.small_m_rows = linear_gemv_rows(self.out_features, in_features, merged=True)
        self.shards: Dict[object, Tuple[int, int]] = {}
        self.tp_slices: Dict[object, Tuple[int, int]] = {}
        off = 0
        for sid, full in shard_sizes.items():
            rows, index = tp_layout[sid]
            self.shards[sid] = (off, rows)
            self.tp_slices[sid] = (index, full)
            off += rows
        if self.quant_block is not None:
            _fp8.check_shard_alignment(self, self.shards)

    def _rank_slice(self, loaded: torch.Tensor, shard_id) -> torch.Tensor:
        """This rank's rows of checkpoint tensor `loaded` of shard `shard_id` (all of them at world size 1)."""
        index, full = self.tp_slices[shard_id]
        rows = self.shards[shard_id][1]
        if loaded.shape[0] != full:
            raise ValueError(f"Shape mismatch for shard {shard_id!r}: {full} rows expected, checkpoint has "
                             f"{tuple(loaded.shape)}.")
        # (narrowing a CheckpointSlice reads only these rows from the file)
        return loaded.narrow(0, index * rows, rows) if rows != full else as_tensor(loaded)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:
            if tp_size() == 1:
                return super().weight_loader(param, loaded)
            # One checkpoint tensor holding every shard, stacked in order: each shard's slice of it (of an FP8
            # weight's scales: its block rows, every shard but the last a whole number of blocks).
            bn = self.quant_block[0] if self.quant_block is not None and param is self.weight_scale_inv else 1
            off = 0
            for sid, (_, full) in self.tp_slices.items():
                self.weight_loader(param, loaded.narrow(0, off // bn, -(-full // bn)), sid)
                off += full
            return None
        if self.quant_block is not None and param is self.weight_scale_inv:
            return _fp8.load_scale_shard(self, param, loaded, shard_id)
        _fp8.check_weight_dtype(self, param, loaded)
        off, size = self.shards[shard_id]
        loaded = self._rank_slice(loaded, shard_id)
        dst = param.data.narrow(0, off, size)
        if dst.shape != loaded.shape:
            raise ValueError(f"Shape mismatch for shard {shard_id!r}: {tuple(dst.shape)} vs "
                             f"checkpoint {tuple(loaded.shape)}.")
        dst.copy_(loaded)

    def shard_ids(self, pname: str) -> List[object]:
        """The shards a complete checkpoint fills of parameter `pname` beyond weight / bias (CausalLM.
        expected_weights): each shard's weight_scale_inv rows."""
        return list(self.shards)

    def split_sizes(self) -> List[int]:
        return [size for _, size in self.shards.values()]


class QKVLinear(MergedLinear):
    """q, k and v projections in one GEMM: rows [q heads | k heads | v heads] of this rank's heads.

    Tensor parallel: rank r holds query heads r * H / tp ...; K/V heads split the same way when tp divides
    them, and when there are fewer K/V heads than ranks each rank holds one, K/V head r // (tp / num_kv_heads),
    replicated on the tp / num_kv_heads ranks whose query heads attend to it (the GQA grouping is kept).
    local_num_heads / local_num_kv_heads: this rank's query / K/V heads (all of them at world size 1)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False) -> None:
        self.local_num_heads, self.local_num_kv_heads, kv_index = qkv_head_split(num_heads, num_kv_heads)
        layout = {"q": (self.local_num_heads * head_dim, tp_rank()),
                  "k": (self.local_num_kv_heads * head_dim, kv_index),
                  "v": (self.local_num_kv_heads * head_dim, kv_index)}
        super().__init__(hidden_size, {"q": num_heads * head_dim, "k": num_kv_heads * head_dim,
                                       "v": num_kv_heads * head_dim}, bias, layout)


def qkv_head_split(num_heads: int, num_kv_heads: int) -> Tuple[int, int, int]:
    """(query heads, K/V heads, which K/V slice) of this rank: heads split evenly, K/V heads replicated when
    fewer than the ranks (QKVLinear)."""
    tp, rank = tp_size(), tp_rank()
    heads = shard_size(num_heads, "num_attention_heads")
    if num_kv_heads >= tp:
        return heads, shard_size(num_kv_heads, "num_key_value_heads"), rank
    if tp % num_kv_heads:
        raise ValueError(f"tensor_parallel_size {tp} is larger than num_key_value_heads ({num_kv_heads}) and not a "
                         "multiple of it: K/V heads can be replicated only evenly.")
    return heads, 1, rank // (tp // num_kv_heads)


class ColumnParallelLinear(Linear):
    """y = x W^T (+ b) with W's output rows split across the ranks: this rank holds rows [r * N / tp, (r + 1) * N /
    tp) (its heads of a per-head projection, e.g. MLA's q_b_proj / kv_b_proj) and produces that slice of y; nothing
    is communicated (the RowParallelLinear after it reduces). One checkpoint tensor, narrowed at load; at world
    size 1 it is Linear. (A projection of several checkpoint tensors is a MergedLinear, column-parallel too.)"""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, shard_size(out_features, "a column-parallel layer's output"), bias)
        self.full_out_features = out_features

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if tp_size() > 1 and (param is self.weight or param is self.bias):
            if loaded.shape[0] != self.full_out_features:
                raise ValueError(f"Shape mismatch: a column-parallel weight of {self.full_out_features} output rows "
                                 f"vs checkpoint {tuple(loaded.shape)}.")
            loaded = loaded.narrow(0, tp_rank() * self.out_features, self.out_features)
        elif tp_size() > 1 and self.quant_block is not None and param is self.weight_scale_inv:
            loaded = _fp8.narrow_scales(self, loaded, 0, self.full_out_features)
        super().weight_loader(param, loaded, shard_id)


class RowParallelLinear(Linear):
    """y = x W^T (+ b) with W's input columns split across the ranks: this rank holds W[:, r * K / tp ...] and
    takes the matching slice of x (a column-parallel layer's output: its heads, its intermediate slice); the
    partial products are summed over the ranks (all-reduce), then the bias is added once. reduce=False leaves
    the partial sum to the caller (an MoE block sums its routed and shared experts' partials, then reduces once).
    At world size 1 it is Linear."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, reduce: bool = True) -> None:
        super().__init__(shard_size(in_features, "a row-parallel layer's input"), out_features, bias)
        self.full_in_features, self.reduce = in_features, reduce

    def forward(self, x: torch.Tensor, add_to: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x: [num_tokens, in_features / tp] -> [num_tokens, out_features]; add_to: as Linear's, after the sum."""
        if not tp_collectives():
            return super().forward(x, add_to)
        if self.bias is None:
            y = super().forward(x)
        else:  # (the bias after the sum, once)
            y = F.linear(x, self.weight) if self.quant_block is None else self._fp8_product(x)
        if self.reduce:
            y = tp_all_reduce(y)
            if self.bias is not None:
                y = y + self.bias
        elif self.bias is not None and tp_rank() == 0:
            y = y + self.bias  # (summed with the other ranks' partials by the caller)
        return y if add_to is None else add_to.add_(y)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param is self.weight and tp_size() > 1:
            if loaded.dim() != 2 or loaded.shape[1] != self.full_in_features:
                raise ValueError(f"Shape mismatch: a row-parallel weight of {self.full_in_features} input columns "
                                 f"vs checkpoint {tuple(loaded.shape)}.")
            loaded = loaded.narrow(1, tp_rank() * self.in_features, self.in_features)
        elif tp_size() > 1 and self.quant_block is not None and param is self.weight_scale_inv:
            loaded = _fp8.narrow_scales(self, loaded, 1, self.full_in_features)
        super().weight_loader(param, loaded, shard_id)
