"""The rotary self-attention block: qkv projection, optional per-head q/k RMSNorm, RoPE, paged attention, o_proj."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from gyrfalcon import envs
from gyrfalcon.kernels.rms_norm import qk_norm_whole
from gyrfalcon.layers.attention import Attention
from gyrfalcon.layers.linear import Linear, QKVLinear
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
                 o_proj_bias: bool = False, qk_norm_whole: bool = False) -> None:
        """qk_norm_eps: per-head RMSNorm of q and k before RoPE with this eps (Qwen3); None: none.
        qk_norm_whole: the q/k norm is instead one RMSNorm over the whole q projection [num_heads * head_dim]
        and one over the whole k projection, before the split into heads (MiniMax-M2)."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.qkv_proj = QKVLinear(hidden_size, head_dim, num_heads, num_kv_heads, qkv_bias)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, o_proj_bias)
        self.rotary_emb = rotary
        self.attn = Attention(num_heads, num_kv_heads, head_dim, head_dim ** -0.5, layer_idx)
        self.use_qk_norm = qk_norm_eps is not None
        self.qk_norm_whole = self.use_qk_norm and qk_norm_whole
        if self.use_qk_norm:
            q_width, k_width = (num_heads * head_dim, num_kv_heads * head_dim) if self.qk_norm_whole else (head_dim,
                                                                                                        head_dim)
            self.q_norm = RMSNorm(q_width, qk_norm_eps)
            self.k_norm = RMSNorm(k_width, qk_norm_eps)
        self.fused = not envs.get().disable_fusion
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
            q = q.view(-1, self.num_heads, self.head_dim)
            k = k.view(-1, self.num_kv_heads, self.head_dim)
            v = v.view(-1, self.num_kv_heads, self.head_dim)
            if self.use_qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary_emb(positions, q, k)
            o = self.attn(q, k, v)
        return project_out(self.o_proj, o, n)

    def _forward_whole_qk_norm(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: the normed input [T, hidden] -> attention output [T, num_heads * head_dim] (qk_norm_whole)."""
        qkv = self.qkv_proj(x)
        if self.fused:  # both norms and the v copy in one launch (not two norms and a cat)
            qkv = qk_norm_whole(qkv, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            return self.attn.forward_fused(qkv, positions, self.rotary_emb)
        q, k, v = qkv.split(self.qkv_proj.split_sizes(), dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        return self.attn(q, k, v)
