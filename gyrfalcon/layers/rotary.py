"""Rotary position embedding: the cos/sin table (with its context-extension scalings) and its use.

The table is built once in fp32 for max_position positions; the kernel gathers rows by position.
Scalings: default, linear, llama3 (Llama 3.1's frequency-dependent interpolation) and YaRN
(NTK-by-parts interpolation plus an attention temperature folded into cos/sin).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import nn

from gyrfalcon.kernels import apply_rotary

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def compute_inv_freq(rotary_dim: int, params: dict,
                     max_position_embeddings: int) -> Tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim // 2] (fp32) and the factor cos/sin are multiplied by."""
    base = float(params.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    exps = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (base ** exps)
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if rope_type == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are interpolated by `factor`, short ones kept, the band between blended.
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled), 1.0
    if rope_type == "yarn":
        orig = params.get("original_max_position_embeddings") or max_position_embeddings
        factor = params.get("factor")
        if factor is None:
            factor = max_position_embeddings / orig
        factor = float(factor)
        attn = params.get("attention_factor")
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        if attn is None:
            attn = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                    if mscale and mscale_all else _yarn_mscale(factor))
        beta_fast = params.get("beta_fast") or 32
        beta_slow = params.get("beta_slow") or 1

        def corr_dim(rot: float) -> float:
            return rotary_dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

        lo, hi = corr_dim(beta_fast), corr_dim(beta_slow)
        if params.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, rotary_dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
        extrapolate = 1 - ramp  # 1 where the dimension keeps its original frequency
        pos_freqs = base ** exps
        inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
        return inv, float(attn)
    raise ValueError(f"Unsupported rope_type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}.")


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k in place of their first `rotary_dim` dims.

    cos_sin_cache: [max_position, rotary_dim] fp32, cos in the first half of the columns.
    """

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, rope_parameters: Optional[dict],
                 max_position_embeddings: Optional[int] = None, is_neox: bool = True) -> None:
        super().__init__()
        self.head_dim, self.rotary_dim, self.is_neox = head_dim, rotary_dim, is_neox
        inv_freq, mscale = compute_inv_freq(rotary_dim, dict(rope_parameters or {}),
                                            max_position_embeddings or max_position)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        cache = torch.cat([freqs.cos() * mscale, freqs.sin() * mscale], dim=-1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions: [num_tokens]; q: [num_tokens, num_heads, head_dim]; k: [num_tokens, num_kv_heads, head_dim]"""
        return apply_rotary(q, k, positions, self.cos_sin_cache, self.rotary_dim, self.is_neox)


def yarn_softmax_scale(params: dict, scale: float) -> float:
    """A softmax scale with YaRN's `mscale_all_dim` temperature applied twice: scale * mscale(factor,
    mscale_all_dim)^2. MLA (DeepSeek) scales the whole q.k product this way, the non-rotary dims too, on top of
    the rotary dims' attention factor already folded into cos/sin; without mscale_all_dim (or with plain
    RoPE) the scale is unchanged."""
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    mscale_all = params.get("mscale_all_dim")
    if rope_type == "default" or not mscale_all:
        return scale
    m = _yarn_mscale(float(params["factor"]), float(mscale_all))
    return scale * m * m


def rope_parameters_of(hf_config) -> dict:
    """The rope parameters of a transformers config (5.x `rope_parameters`, older `rope_scaling`)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0) or 10000.0)
    params.setdefault("rope_type", params.get("type", "default") or "default")
    return params
