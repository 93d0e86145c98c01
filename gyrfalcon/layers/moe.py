"""Mixture-of-experts blocks: the router (which experts each token goes to, with what weights) and the sparse
MoE block that fills a decoder layer's MLP slot (router + fused experts + optional shared expert).

Router variants (`scoring`):
- "softmax": p = softmax(logits) in fp32, the top-k of p, renormalized to sum 1 when norm_topk_prob
  (Qwen3-MoE, Qwen3-Next, Qwen3.5).
- "sigmoid": s = sigmoid(logits) in fp32; experts chosen by the top-k of s + e_score_correction_bias (the bias
  only selects); weights are the chosen experts' unbiased s, normalized to sum 1 when norm_topk_prob, times
  routed_scaling_factor (MiniMax-M2: normalized, factor 1). With n_group > 1 the selection is DeepSeek's
  grouped noaux_tc: each group of experts scores the sum of its top-2 biased scores, the topk_group best
  groups stay, the top-k experts are picked among theirs (DeepSeek-V3: factor 2.5).

Tensor parallelism (gyrfalcon/distributed; docs/parallelism.md): the router is replicated, so every rank routes
every token the same way. FusedExperts then holds either a slice of every expert's intermediate dim (the default)
or, with expert parallelism, tp-th of the experts whole (running only the pairs routed to them); either way each
rank's output is a partial sum over its share of the work, added to the shared expert's partial, and SparseMoE
all-reduces that once. The shared expert is split by its intermediate dim on every rank (expert parallelism or not),
so its partials too sum to it exactly once.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from gyrfalcon.distributed import as_tensor, expert_parallel, shard_size, tp_all_reduce, tp_rank
from gyrfalcon.kernels.fused_moe import fused_moe
from gyrfalcon.kernels.moe_router import SIGMOID, SOFTMAX, route
from gyrfalcon.layers.activation import SiluAndMul
from gyrfalcon.layers.linear import Linear, MergedLinear, RowParallelLinear
from gyrfalcon.layers.norm import RMSNorm
from gyrfalcon.layers.norm_linear import NormLinear
from gyrfalcon.layers.quantization import fp8 as _fp8



class Router(nn.Module):
    """x [T, hidden] -> (topk_weights [T, k] fp32, topk_ids [T, k] int64). weight: [E, hidden] (the checkpoint's
    `gate.weight`); e_score_correction_bias: [E] fp32 (sigmoid scoring with use_bias).

    logits_fp32: the logits GEMM itself in fp32 (DeepSeek-V3 as transformers runs it); otherwise it runs in x's
    dtype and only the scores are fp32 (Qwen3-MoE, MiniMax-M2)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, scoring: str = SOFTMAX,
                 norm_topk_prob: bool = True, use_bias: bool = False, n_group: int = 1, topk_group: int = 1,
                 routed_scaling_factor: float = 1.0, logits_fp32: bool = False) -> None:
        super().__init__()
        if scoring not in (SOFTMAX, SIGMOID):
            raise ValueError(f"Unsupported router scoring {scoring!r}; expected {SOFTMAX!r} or {SIGMOID!r}.")
        if num_experts % n_group or not 1 <= topk_group <= n_group:
            raise ValueError(f"n_group {n_group} / topk_group {topk_group} do not fit {num_experts} experts.")
        if top_k > num_experts:
            raise ValueError(f"top_k {top_k} > {num_experts} experts.")
        self.num_experts, self.top_k, self.scoring = num_experts, top_k, scoring
        self.norm_topk_prob, self.n_group, self.topk_group = norm_topk_prob, n_group, topk_group
        self.routed_scaling_factor, self.logits_fp32 = float(routed_scaling_factor), logits_fp32
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                     requires_grad=False) if use_bias else None)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, E] (fp32 when logits_fp32, else x's dtype)."""
        if self.logits_fp32:
            return F.linear(x.float(), self.weight.float())
        return F.linear(x, self.weight.to(x.dtype))

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.select(self.logits(x))

    def select(self, logits: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """logits: [T, E] -> (topk_weights [T, k] fp32, topk_ids [T, k] int64): kernels/moe_router (one launch on
        a GPU but for the grouped selection; its naive.py is the reference of every variant above)."""
        return route(logits, self.top_k, self.scoring, self.norm_topk_prob, self.e_score_correction_bias,
                     self.n_group, self.topk_group, self.routed_scaling_factor)


class FusedExperts(nn.Module):
    """The routed experts' SwiGLU weights stacked: w13 [E, 2I, hidden] (each expert's gate rows, then its up
    rows), w2 [E, hidden, I]. The checkpoint stores them per expert; CausalLM.load_weights hands each tensor to
    weight_loader with shard (expert, half): half 0 / 1 the gate / up rows of w13, None the whole w2[expert].

    FP8 (built under fp8_scope(block), layers/quantization/fp8.py): w13 / w2 float8_e4m3fn with block scales
    w13_weight_scale_inv [E, ceil(2I / bn), ceil(hidden / bk)] and w2_weight_scale_inv [E, ceil(hidden / bn),
    ceil(I / bk)] (quant_block (bn, bk)), named so that a checkpoint's `experts.<e>.<proj>.weight_scale_inv` lands
    in `experts.<stacked>_weight_scale_inv` at the same shard (expert, half) as its weight: the gate / up scale
    rows stack like the weight rows (I % bn == 0, checked by prepare_model). `--quantization fp8` gives the same
    layout, quantized at load. Either runs kernels/fused_moe's FP8 mode.

    Tensor parallel: each rank holds I / tp of every expert's intermediate rows (w13's gate and up rows, w2's
    columns); with expert parallelism it holds experts [r * E / tp, (r + 1) * E / tp) whole and computes only the
    (token, expert) pairs routed to them (~T * k / tp rows through its GEMMs). Either way forward returns this rank's
    partial sum (SparseMoE reduces it). Expert indices in shards and topk_ids stay global."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.expert_parallel = expert_parallel()
        if self.expert_parallel:
            self.num_local_experts = shard_size(num_experts, "the number of experts (expert parallelism)")
            self.intermediate_size = intermediate_size
        else:
            self.num_local_experts = num_experts
            self.intermediate_size = shard_size(intermediate_size, "moe_intermediate_size")
        self.expert_start = tp_rank() * self.num_local_experts if self.expert_parallel else 0
        self.full_intermediate_size = intermediate_size
        self.w13 = nn.Parameter(torch.empty(self.num_local_experts, 2 * self.intermediate_size, hidden_size),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.num_local_experts, hidden_size, self.intermediate_size),
                               requires_grad=False)
        self.quant_block: Optional[Tuple[int, int]] = None  # (bn, bk) when the experts are FP8
        block = _fp8.current_weight_block()
        if block is not None:
            _fp8.init_fp8_experts(self, block)

    def shard_ids(self, pname: str):
        """The shards load_weights reports for parameter `pname` of a complete checkpoint (the scales too: a
        checkpoint missing one expert's scale is incomplete)."""
        halves = (0, 1) if pname in ("w13", "w13_weight_scale_inv") else (None,)
        return [(e, h) for e in range(self.num_experts) for h in halves]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard) -> None:
        expert, half = shard
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"Expert {expert} out of range: this layer has {self.num_experts} experts.")
        expert -= self.expert_start
        if not 0 <= expert < self.num_local_experts:
            return None  # another rank's expert (expert parallelism)
        if self.quant_block is not None and param is not self.w13 and param is not self.w2:
            return _fp8.load_expert_scale(self, param, as_tensor(loaded), expert, half)
        dst = param.data[expert]
        if half is not None:
            dst = dst.narrow(0, half * self.intermediate_size, self.intermediate_size)
        if self.intermediate_size != self.full_intermediate_size:  # this rank's slice of the expert
            full, i = self.full_intermediate_size, self.intermediate_size
            dim = 0 if half is not None else 1
            if loaded.dim() != 2 or loaded.shape[dim] != full:
                raise ValueError(f"Shape mismatch for expert {expert + self.expert_start} shard {half}: "
                                 f"{full} intermediate rows expected, checkpoint {tuple(loaded.shape)}.")
            loaded = loaded.narrow(dim, tp_rank() * i, i)
        loaded = as_tensor(loaded)
        if dst.shape != loaded.shape:
            raise ValueError(f"Shape mismatch for expert {expert} shard {half}: {tuple(dst.shape)} vs checkpoint "
                             f"{tuple(loaded.shape)}.")
        dst.copy_(loaded)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden]; topk_weights [T, k] fp32; topk_ids [T, k] (global) -> [T, hidden] (this rank's partial
        sum under tensor parallelism)."""
        # Expert parallelism: the op computes only the pairs routed to this rank's experts (kernels/fused_moe's
        # expert_start: the others get no row in its sort); at world size 1 every expert is local (the default).
        ep = {"expert_start": self.expert_start, "total_experts": self.num_experts} if self.expert_parallel else {}
        if self.quant_block is not None:
            return fused_moe(x, self.w13, self.w2, topk_weights, topk_ids, self.w13_weight_scale_inv,
                             self.w2_weight_scale_inv, self.quant_block, **ep)
        return fused_moe(x, self.w13, self.w2, topk_weights, topk_ids, **ep)


class SharedExpert(nn.Module):
    """An always-on SwiGLU expert on the normed input: down(silu(gate x) * up x), gate and up in gate_up_proj."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, {0: intermediate_size, 1: intermediate_size})
        self.act = SiluAndMul()
        # (tensor parallel: a partial sum, reduced by SparseMoE together with the routed experts')
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, reduce=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class SparseMoE(nn.Module):
    """The MLP slot of an MoE decoder layer: x = norm(stream); out = experts(x; router(x)) [+ shared(x)
    [* sigmoid(shared_expert_gate(x))]]. The input norm runs as its own kernel (NormLinear without a linear:
    never folded); the output is carried to the next block's norm.

    Parameter names follow the checkpoints: gate (the router), experts (w13 / w2), shared_expert or
    shared_experts, shared_expert_gate."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 router: Optional[Router] = None, shared_intermediate_size: int = 0, shared_gate: bool = False,
                 shared_name: str = "shared_expert", **router_kwargs) -> None:
        super().__init__()
        self.gate = router if router is not None else Router(hidden_size, num_experts, top_k, **router_kwargs)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size)
        self.shared_name = shared_name if shared_intermediate_size else None
        if shared_intermediate_size:
            setattr(self, shared_name, SharedExpert(hidden_size, shared_intermediate_size))
        self.shared_expert_gate = Linear(hidden_size, 1) if shared_intermediate_size and shared_gate else None
        self.norm_in: Optional[NormLinear] = None

    def bind_input_norm(self, norm: RMSNorm) -> None:
        self.norm_in = NormLinear(norm)

    def forward(self, hidden: Optional[torch.Tensor],
                residual: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
        """(hidden, residual): the residual stream (layers/norm_linear.py) -> the stream after this block."""
        n = self.norm_in(hidden, residual)
        x = n.y
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_name is not None:
            shared = getattr(self, self.shared_name)(x)
            if self.shared_expert_gate is not None:
                shared = shared * torch.sigmoid(self.shared_expert_gate(x))
            out = out + shared
        return tp_all_reduce(out), n.residual
