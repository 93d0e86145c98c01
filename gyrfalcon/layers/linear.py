"""Linear layers, including the fused projections filled from separate checkpoint tensors.

A checkpoint stores q_proj, k_proj and v_proj (and gate_proj, up_proj) apart; gyrfalcon keeps each
group in one weight so one GEMM does the work. `weight_loader(param, tensor, shard_id)` copies a
checkpoint tensor into its rows of the fused weight.

FP8 (layers/quantization/fp8.py): a Linear built inside fp8_scope(block) holds a float8_e4m3fn weight and a
`weight_scale_inv` Parameter (quant_block set) and runs through kernels/fp8_gemm; a fused layer's scale shards
land at row offsets in blocks. quant_block None: the plain weight in the model dtype.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from gyrfalcon import envs
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
            y = fp8_block_gemm(x.reshape(-1, x.shape[-1]), self.weight, self.weight_scale_inv, self.quant_block)
            y = y.view(*x.shape[:-1], self.out_features)
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

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _fp8.check_weight_dtype(self, param, loaded)
        if param.shape != loaded.shape:
            raise ValueError(f"Shape mismatch: parameter {tuple(param.shape)} vs checkpoint "
                             f"{tuple(loaded.shape)}.")
        param.data.copy_(loaded)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim (gate_up, qkv).

    `shards` maps a shard id to (row offset, rows) in the fused weight.
    """

    def __init__(self, in_features: int, shard_sizes: Dict[object, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        # qkv and gate_up of 2-16 rows stay with cuBLAS, unless their shape has a launch shape of its own
        # (small_m_gemv.ROWS_SHAPES); single rows take the GEMV with the norm fused (layers/norm_linear.py).
        self.small_m_rows = linear_gemv_rows(self.out_features, in_features, merged=True)
        self.shards: Dict[object, Tuple[int, int]] = {}
        off = 0
        for sid, size in shard_sizes.items():
            self.shards[sid] = (off, size)
            off += size
        if self.quant_block is not None:
            _fp8.check_shard_alignment(self, self.shards)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:
            return super().weight_loader(param, loaded)
        if self.quant_block is not None and param is self.weight_scale_inv:
            return _fp8.load_scale_shard(self, param, loaded, shard_id)
        _fp8.check_weight_dtype(self, param, loaded)
        off, size = self.shards[shard_id]
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
    """q, k and v projections in one GEMM: rows [q heads | k heads | v heads]."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False) -> None:
        super().__init__(hidden_size, {"q": num_heads * head_dim, "k": num_kv_heads * head_dim,
                                       "v": num_kv_heads * head_dim}, bias)
