"""The rotary self-attention block: qkv projection, optional per-head q/k RMSNorm, RoPE, paged attention, o_proj.

Tensor parallelism splits the heads (QKVLinear, RowParallelLinear). A per-head q/k norm is replicated; MiniMax-M2's
whole-projection q/k norm spans every rank's heads: each rank holds its heads' slice of the norm weights, and the
sum of squares of q and of k is all-reduced (one [T, 2] all-reduce a layer) before each rank scales its part.
"""

from __future__ import annotations

from functools import partial
from typing import Optional, Tuple

import torch
from torch import nn

from gyrfalcon import envs
from gyrfalcon.distributed import as_tensor, tp_all_reduce, tp_rank, tp_size
from gyrfalcon.kernels.rms_norm import qk_norm_whole
from gyrfalcon.layers.attention import Attention
from gyrfalcon.layers.linear import QKVLinear, RowParallelLinear
from gyrfalcon.layers.norm import RMSNorm
from gyrfalcon.layers.norm_linear import NormLinear, project_out
from gyrfalcon.layers.rotary import RotaryEmbedding


class RotarySelfAttention(nn.Module):
    """x [T, hidden] -> o_proj(attention(rope(qk_norm(q)), rope(qk_norm(k)), v)) [T, hidden].

    The fused path (the default) hands the qkv rows to the attention backend, which does the q/k norm, RoPE and
    the K/V write in its own launches (Attention.forward_fused); with GYRFALCON_DISABLE_FUSION=1 each of those
    runs as its own kernel here. The input norm is the decoder layer's; bind_input_norm pairs it with qkv_proj.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int,
                 rotary: RotaryEmbedding, qk_norm_eps: Optional[float] = None, qkv_bias: bool = False,
                 o_proj_bias: bool = False, qk_norm_whole: bool = False, output_gate: bool = False,
                 qk_norm_offset: float = 0.0) -> None:
        """qk_norm_eps: per-head RMSNorm of q and k before RoPE with this eps (Qwen3); None: none.
        qk_norm_whole: the q/k norm is instead one RMSNorm over the whole q projection [num_heads * head_dim]
        and one over the whole k projection, before the split into heads (MiniMax-M2).
        output_gate: q_proj gives each head [query | gate] (2 * head_dim rows per head) and the attention output
        is multiplied by sigmoid(gate) before o_proj (Qwen3-Next's gated attention). qk_norm_offset: the q/k
        norms' weight offset (1: Qwen3-Next's zero-centred `* (1 + w)`)."""
        super().__init__()
        self.output_gate = output_gate
        # (the q shard holds the gate rows too: the checkpoint's q_proj [num_heads * 2 * head_dim, hidden]; per
        # head [query | gate], so splitting its 2 * num_heads head_dim-row blocks keeps each head's pair whole)
        self.qkv_proj = QKVLinear(hidden_size, head_dim, num_heads * (2 if output_gate else 1), num_kv_heads,
                                  qkv_bias)
        # This rank's heads (all of them at world size 1): tensor parallelism splits them (QKVLinear).
        num_heads = self.qkv_proj.local_num_heads // (2 if output_gate else 1)
        num_kv_heads = self.qkv_proj.local_num_kv_heads
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.o_proj = RowParallelLinear(self.num_heads * tp_size() * head_dim, hidden_size, o_proj_bias)
        self.rotary_emb = rotary
        self.attn = Attention(num_heads, num_kv_heads, head_dim, head_dim ** -0.5, layer_idx)
        self.use_qk_norm = qk_norm_eps is not None
        self.qk_norm_whole = self.use_qk_norm and qk_norm_whole
        if self.use_qk_norm:
            q_width, k_width = (num_heads * head_dim, num_kv_heads * head_dim) if self.qk_norm_whole else (head_dim,
                                                                                                        head_dim)
            self.q_norm = RMSNorm(q_width, qk_norm_eps, qk_norm_offset)
            self.k_norm = RMSNorm(k_width, qk_norm_eps, qk_norm_offset)
        # A whole-projection norm across ranks (module docstring): each rank's slice of its weights.
        self.norm_across_ranks = self.qk_norm_whole and tp_size() > 1
        if self.norm_across_ranks:
            kv_index = self.qkv_proj.tp_slices["k"][0]
            self.q_norm.weight.shard_loader = partial(_load_norm_slice, index=tp_rank())
            self.k_norm.weight.shard_loader = partial(_load_norm_slice, index=kv_index)
        # The fused qkv prep takes neither the gate's rows nor (1 + w) norms: such layers run the separate ops.
        self.fused = not envs.get().disable_fusion and not output_gate and qk_norm_offset == 0.0
        self.qkv_in: Optional[NormLinear] = None

    def bind_input_norm(self, norm: RMSNorm) -> None:
        # A whole-projection q/k norm needs q and k normalized by the true input rstd before its own norm: the
        # input norm runs on its own (never folded into qkv_proj), and the fused qkv prep gets no norms.
        self.qkv_in = NormLinear(norm) if self.qk_norm_whole else NormLinear(norm, self.qkv_proj)

    def forward(self, positions: torch.Tensor, hidden: Optional[torch.Tensor],
                residual: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
        """positions: [T]; (hidden, residual): the residual stream (layers/norm_linear.py) -> the stream after
        this block."""
        n = self.qkv_in(hidden, residual)
        if self.qk_norm_whole:
            return project_out(self.o_proj, self._forward_whole_qk_norm(positions, n.y), n)
        if self.fused:
            norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.use_qk_norm else None
            o = self.attn.forward_fused(n.y, positions, self.rotary_emb, norms, n.row_scale)
        else:
            assert n.row_scale is None, "folded norms need the fused attention path"
            q, k, v = n.y.split(self.qkv_proj.split_sizes(), dim=-1)
            gate = None
            if self.output_gate:  # per head [query | gate]
                q, gate = q.reshape(-1, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            q = q.reshape(-1, self.num_heads, self.head_dim)
            k = k.view(-1, self.num_kv_heads, self.head_dim)
            v = v.view(-1, self.num_kv_heads, self.head_dim)
            if self.use_qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary_emb(positions, q, k)
            o = self.attn(q, k, v)
            if gate is not None:
                o = o * torch.sigmoid(gate.reshape(o.shape))
        return project_out(self.o_proj, o, n)

    def _forward_whole_qk_norm(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: the normed input [T, hidden] -> attention output [T, num_heads * head_dim] (qk_norm_whole)."""
        qkv = self.qkv_proj(x)
        if self.fused and not self.norm_across_ranks:  # both norms and the v copy in one launch (not two and a cat)
            qkv = qk_norm_whole(qkv, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            return self.attn.forward_fused(qkv, positions, self.rotary_emb)
        q, k, v = qkv.split(self.qkv_proj.split_sizes(), dim=-1)
        if self.norm_across_ranks:
            q, k = self._qk_norm_across_ranks(q, k)
        else:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        return self.attn(q, k, v)

    def _qk_norm_across_ranks(self, q: torch.Tensor, k: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """q [T, local q width], k [T, local k width]: this rank's parts of the whole projections -> both normed by
        the RMS of the whole projection (every rank's part), in fp32 as RMSNorm computes it."""
        qf, kf = q.float(), k.float()
        squares = torch.stack([qf.pow(2).sum(-1), kf.pow(2).sum(-1)], dim=-1)  # [T, 2]
        tp_all_reduce(squares)
        tp = tp_size()
        # K/V heads replicated on c ranks (fewer K/V heads than ranks) are summed c times, over a whole width of
        # local width * tp / c: the mean is the sum over width * tp either way.
        mean_q = squares[:, :1] / (q.shape[-1] * tp)
        mean_k = squares[:, 1:] / (k.shape[-1] * tp)
        out = []
        for x, mean, norm in ((qf, mean_q, self.q_norm), (kf, mean_k, self.k_norm)):
            out.append((x * torch.rsqrt(mean + norm.eps) * (norm.weight.float() + norm.weight_offset)).to(q.dtype))
        return out[0], out[1]


def _load_norm_slice(param: torch.nn.Parameter, loaded, index: int) -> None:
    """A whole-projection norm weight [H * D] from the checkpoint -> slice `index` of this rank's width."""
    n = param.shape[0]
    if loaded.dim() != 1 or loaded.shape[0] % n:
        raise ValueError(f"Shape mismatch: a q/k norm slice of {n} vs checkpoint {tuple(loaded.shape)}.")
    param.data.copy_(loaded.narrow(0, index * n, n) if loaded.shape[0] != n else as_tensor(loaded))
