"""Random draw of one token per row from (already temperature-scaled and masked) logits: Gumbel-max.

token[s] = argmax_i (z[s, i] + g(seed[s], offset[s], i)),   g = -log(-log(u)),  u ~ U(0, 1)

which draws token i with probability softmax(z[s])_i: no softmax, no normalization, masked entries
(-inf) never win. The uniforms come from a counter-based hash of (seed, offset, vocabulary index)
rather than a stateful generator, so
  - a draw needs no host sync and no per-row launch (a seeded request used to need its own generator
    call per step), and the GPU kernel and the CPU reference draw the same numbers;
  - a seeded request's draws depend only on its seed and the offset it passes (its output position),
    never on the batch around it.

z: [S, V] float; seeds, offsets: [S] int64 (>= 0). Returns [S] int64.

Hash: murmur3's 32-bit finalizer over the seed's two halves, the offset and the index; the top 24 bits
of the result make u = (k + 0.5) / 2^24, exactly representable in fp32 and never 0 or 1. Products are
taken mod 2^32 in 16-bit halves so that int64 arithmetic never overflows (same integers everywhere).
"""

from __future__ import annotations

import logging

import torch

from gyrfalcon.kernels._common import HAS_TRITON, next_pow2, tl, triton, use_triton
from gyrfalcon.kernels.argmax import _split

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


if HAS_TRITON:

    @triton.jit
    def _mul32_tl(x, c: tl.constexpr):
        return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF

    @triton.jit
    def _fmix32_tl(x):
        x = x ^ (x >> 16)
        x = _mul32_tl(x, 0x85EBCA6B)
        x = x ^ (x >> 13)
        x = _mul32_tl(x, 0xC2B2AE35)
        return x ^ (x >> 16)

    @triton.jit
    def _gumbel_argmax_kernel(z_ptr, seeds_ptr, offsets_ptr, out_ptr, part_s_ptr, part_i_ptr, V, stride_z, chunk,
                              P, BLOCK: tl.constexpr, FINAL: tl.constexpr):
        # Grid: (S, P). Program (row, p) streams [p * chunk, (p + 1) * chunk) of its row once, keeping a
        # running best per lane; FINAL (P == 1): it writes the token, else its chunk's (best score, lowest
        # index holding it) for _gumbel_reduce_kernel.
        row = tl.program_id(0)
        p = tl.program_id(1)
        seed = tl.load(seeds_ptr + row).to(tl.int64)
        offset = tl.load(offsets_ptr + row).to(tl.int64)
        # row_keys, in-kernel (no extra launches).
        h = _fmix32_tl((seed & 0xFFFFFFFF)
                       ^ _fmix32_tl(((seed >> 32) & 0xFFFFFFFF) ^ _mul32_tl(offset & 0xFFFFFFFF, 0x9E3779B1)))
        offs = tl.arange(0, BLOCK)
        lo = p * chunk
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_i = tl.zeros([BLOCK], tl.int64) + V
        for start in range(0, chunk, BLOCK):
            idx = lo + start + offs
            mask = idx < V
            z = tl.load(z_ptr + row.to(tl.int64) * stride_z + idx, mask=mask, other=float("-inf")).to(tl.float32)
            x = _fmix32_tl(h ^ _mul32_tl(idx.to(tl.int64), 0x9E3779B1))
            u = ((x >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
            score = z - tl.log(-tl.log(u))
            take = mask & (score > best)  # strictly greater: a lane keeps its first maximum
            best = tl.where(take, score, best)
            best_i = tl.where(take, idx.to(tl.int64), best_i)
        m = tl.max(best, axis=0)
        winner = tl.min(tl.where(best == m, best_i, V), axis=0)
        if FINAL:
            # A row whose every entry is -inf (cannot happen after masking: the top token survives) -> 0.
            tl.store(out_ptr + row, tl.where(winner < V, winner, 0))
        else:
            tl.store(part_s_ptr + row * P + p, m)
            tl.store(part_i_ptr + row * P + p, winner)

    @triton.jit
    def _gumbel_reduce_kernel(part_s_ptr, part_i_ptr, out_ptr, P, V, BLOCK_P: tl.constexpr):
        # Grid: (S,). The row's P chunk partials, in index order: the best score, then the lowest index
        # holding it, which is what one program streaming the whole row finds.
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK_P)
        mask = offs < P
        sc = tl.load(part_s_ptr + row * P + offs, mask=mask, other=float("-inf"))
        ix = tl.load(part_i_ptr + row * P + offs, mask=mask, other=V)
        m = tl.max(sc, axis=0)
        winner = tl.min(tl.where(mask & (sc == m), ix, V), axis=0)
        tl.store(out_ptr + row, tl.where(winner < V, winner, 0))


def gumbel_argmax_triton(z: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor, block: int = 2048,
                         min_chunk: int = 4096, target_programs: int = 512) -> torch.Tensor:
    """Each row is cut into P chunks of >= min_chunk elements, one program each, ~target_programs in all (the
    split of kernels/argmax.py), and a second launch picks each row's winner among its chunks' (P == 1: one
    launch). One program per row streamed the whole vocabulary alone: 124.5 us of a Qwen3-0.6B batch-1 step
    sampled at temperature 1.0 on the H200, where the greedy argmax's split took ~3.6 us."""
    assert z.dim() == 2 and z.stride(-1) == 1
    S, V = z.shape
    out = torch.empty(S, dtype=torch.int64, device=z.device)
    if S == 0:
        return out
    chunk, P = _split(S, V, block, min_chunk, target_programs)
    if P == 1:
        _gumbel_argmax_kernel[(S, 1)](z, seeds, offsets, out, out, out, V, z.stride(0), chunk, 1,
                                      BLOCK=block, FINAL=True, num_warps=8)
        return out
    part_s = torch.empty(S * P, dtype=torch.float32, device=z.device)
    part_i = torch.empty(S * P, dtype=torch.int64, device=z.device)
    _gumbel_argmax_kernel[(S, P)](z, seeds, offsets, out, part_s, part_i, V, z.stride(0), chunk, P,
                                  BLOCK=block, FINAL=False, num_warps=8)
    BLOCK_P = max(16, next_pow2(P))
    _gumbel_reduce_kernel[(S,)](part_s, part_i, out, P, V, BLOCK_P=BLOCK_P, num_warps=1 if BLOCK_P <= 128 else 4)
    return out


_TRITON_FAILED = False


def gumbel_argmax(z: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[S, V] logits, [S] seeds, [S] offsets -> [S] int64 tokens; see the module docstring.

    Every sampled request goes through here: if the Triton kernel cannot be built on this GPU, the
    reference (the same numbers, a few more launches) takes over, with a warning, rather than failing
    every request."""
    global _TRITON_FAILED
    if use_triton(z) and not _TRITON_FAILED:
        try:
            return gumbel_argmax_triton(z, seeds, offsets)
        except Exception as e:  # compilation / launch failure, not a data error
            _TRITON_FAILED = True
            logging.getLogger(__name__).warning("Triton sampling kernel unavailable (%s: %s); using the "
                                                "torch reference", type(e).__name__, e)
    return gumbel_argmax_ref(z, seeds, offsets)
