"""The plain-torch Gumbel-max draw and its counter-based hash (the CPU path; the kernel draws the same numbers)."""

from __future__ import annotations

import torch


_M32 = 0xFFFFFFFF
_C1, _C2, _GOLDEN = 0x85EBCA6B, 0xC2B2AE35, 0x9E3779B1


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for 0 <= x < 2^32, in int64 without overflow."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 13)
    x = _mul32(x, _C2)
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[S] int64 in [0, 2^32): one key per (seed, offset)."""
    seeds, offsets = seeds.long(), offsets.long()
    s_lo, s_hi = seeds & _M32, (seeds >> 32) & _M32
    return _fmix32(s_lo ^ _fmix32(s_hi ^ _mul32(offsets & _M32, _GOLDEN)))


def hash_uniform_ref(seeds: torch.Tensor, offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    """[S, V] fp32 uniforms in (0, 1)."""
    h = row_keys(seeds, offsets).unsqueeze(1)
    idx = torch.arange(vocab, dtype=torch.int64, device=seeds.device).unsqueeze(0)
    x = _fmix32(h ^ _mul32(idx, _GOLDEN))
    return ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def gumbel_argmax_ref(z: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    u = hash_uniform_ref(seeds, offsets, z.shape[-1])
    g = -torch.log(-torch.log(u))
    return (z.float() + g).argmax(dim=-1)
