"""Greedy token choice: the first index of each row's maximum, split over many programs per row.

logits: [S, V] float (fp32, bf16 or fp16) -> [S] int64, exactly torch's `logits.argmax(dim=-1)`:
  - ties go to the FIRST (lowest) index;
  - a row of all -inf gives index 0 (the first of its equal maxima);
  - NaN counts as larger than everything, +inf included, and the first NaN wins (torch's rule);
  - -0.0 and +0.0 are equal (the first of them wins among equal maxima).

Why a kernel: torch reduces a row of a large vocabulary in one thread block, so with few rows most of
the GPU idles (H200: ~27 us for one row of 128,256 fp32 logits), while the data is half a megabyte.
Here a row is cut into chunks, one program each:
  stage 1, grid (S, P): a program scans its contiguous chunk, BLOCK elements per iteration, keeping a
      running best per lane (strictly greater replaces, so each lane keeps its first maximum), then
      reduces its lanes to (key of the maximum, lowest index holding it) and writes that partial;
  stage 2, grid (S,): reduces a row's P partials the same way (chunks are in index order, so the lowest
      index among equal keys is the row's first maximum).
No host sync, and every buffer's shape follows from (S, V) alone, so it captures into CUDA graphs.
When P would be 1 (short rows) stage 1 writes the answer itself and stage 2 is not launched.

Comparisons run on order-preserving int32 keys rather than floats: key(x) = bits ^ ((bits >> 31) &
0x7FFFFFFF) (bits as int32) orders every non-NaN float like `<` does; NaN (any payload or sign) maps to
INT32_MAX, above +inf; +-0.0 map to 0. Integer max / compare has no NaN special cases and is exact.

Launch shape, from S and V only (argmax_launch): P chunks per row, P = min(V / min_chunk, 512 / S),
so ~512 programs in flight (~4 per H200 SM) when rows are few, and chunks of >= min_chunk elements.
From 256 rows on, torch's own argmax runs instead: with one block per row it already has >= ~2 blocks
per SM and reads at bandwidth (in principle: not measured), so splitting rows would only add a launch.
"""

from __future__ import annotations

import logging
from typing import Optional, Tuple

import torch

from gyrfalcon.kernels._common import HAS_TRITON, cdiv, next_pow2, tl, triton, use_triton

# Launch-shape constants. On the H200 (these defaults, hot cache) fp32 rows of 128,256 took 3.8 / 5.5 / 11.0 us
# at S = 1 / 16 / 64 against torch's 26.8 / 26.9 / 27.2; not swept further.
BLOCK = 4096           # elements per stage-1 iteration
NUM_WARPS = 8
MIN_CHUNK = 4096       # elements per stage-1 program, at least
TARGET_PROGRAMS = 512  # stage-1 programs to aim for when rows are few
TORCH_MIN_ROWS = 256   # from this many rows on, torch's argmax (see the module docstring)


def greedy_argmax_ref(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def argmax_launch(S: int, V: int, block: int = BLOCK, min_chunk: int = MIN_CHUNK,
                  target_programs: int = TARGET_PROGRAMS) -> Optional[Tuple[int, int]]:
    """(chunk, P): elements per stage-1 program (a multiple of block) and programs per row; None when
    torch's argmax should run instead (S >= TORCH_MIN_ROWS)."""
    if S >= TORCH_MIN_ROWS:
        return None
    return _split(S, V, block, min_chunk, target_programs)


def _split(S: int, V: int, block: int, min_chunk: int, target_programs: int) -> Tuple[int, int]:
    P = max(1, min(cdiv(V, max(min_chunk, block)), cdiv(target_programs, max(S, 1))))
    chunk = cdiv(cdiv(V, P), block) * block
    return chunk, cdiv(V, chunk)


if HAS_TRITON:

    @triton.jit
    def _argmax_key(x):
        """fp32 -> int32 key, ordered as the floats are; NaN above +inf; -0.0 == +0.0. Integer tests
        only, so that no float compare (and no flush of subnormals to zero) is involved."""
        b = x.to(tl.int32, bitcast=True)
        mag = b & 0x7FFFFFFF
        k = tl.where(mag == 0, 0, b ^ ((b >> 31) & 0x7FFFFFFF))
        return tl.where(mag > 0x7F800000, 0x7FFFFFFF, k)

    @triton.jit
    def _argmax_partial_kernel(x_ptr, part_ptr, out_ptr, V, stride_x, chunk, P,
                               BLOCK: tl.constexpr, FINAL: tl.constexpr):
        # Grid (S, P). Program (row, p) scans [p * chunk, (p + 1) * chunk) of its row.
        row = tl.program_id(0)
        p = tl.program_id(1)
        lo = p * chunk
        offs = tl.arange(0, BLOCK)
        base = x_ptr + row.to(tl.int64) * stride_x
        best_k = tl.full([BLOCK], -2147483648, tl.int32)  # below key(-inf): any element replaces it
        best_i = tl.zeros([BLOCK], tl.int32) + V
        for start in range(0, chunk, BLOCK):
            idx = lo + start + offs
            mask = idx < V
            x = tl.load(base + idx, mask=mask, other=float("-inf")).to(tl.float32)
            k = _argmax_key(x)
            take = mask & (k > best_k)  # strictly greater: a lane keeps its first maximum
            best_k = tl.where(take, k, best_k)
            best_i = tl.where(take, idx, best_i)
        m = tl.max(best_k, axis=0)
        i = tl.min(tl.where(best_k == m, best_i, V), axis=0)
        if FINAL:
            tl.store(out_ptr + row, i.to(tl.int64))
        else:
            # part: [2, S, P] int32, keys then indices.
            n = tl.num_programs(0) * P
            tl.store(part_ptr + row * P + p, m)
            tl.store(part_ptr + n + row * P + p, i)

    @triton.jit
    def _argmax_reduce_kernel(part_ptr, out_ptr, P, V, BLOCK_P: tl.constexpr):
        # Grid (S,): the row's P partials, in chunk order.
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK_P)
        mask = offs < P
        n = tl.num_programs(0) * P
        k = tl.load(part_ptr + row * P + offs, mask=mask, other=-2147483648)
        i = tl.load(part_ptr + n + row * P + offs, mask=mask, other=V)
        m = tl.max(k, axis=0)
        tl.store(out_ptr + row, tl.min(tl.where(mask & (k == m), i, V), axis=0).to(tl.int64))


def greedy_argmax_triton(logits: torch.Tensor, block: int = BLOCK, min_chunk: int = MIN_CHUNK,
                         target_programs: int = TARGET_PROGRAMS, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """The two-stage kernel at any S (argmax_launch's torch cut-over is the dispatcher's business)."""
    assert logits.dim() == 2 and logits.is_floating_point()
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    S, V = logits.shape
    out = torch.empty(S, dtype=torch.int64, device=logits.device)
    if S == 0:
        return out
    assert 0 < V < 2**31 - 1, V
    chunk, P = _split(S, V, block, min_chunk, target_programs)
    if P == 1:
        _argmax_partial_kernel[(S, 1)](logits, out, out, V, logits.stride(0), chunk, 1,
                                       BLOCK=block, FINAL=True, num_warps=num_warps)
        return out
    part = torch.empty(2 * S * P, dtype=torch.int32, device=logits.device)
    _argmax_partial_kernel[(S, P)](logits, part, out, V, logits.stride(0), chunk, P,
                                   BLOCK=block, FINAL=False, num_warps=num_warps)
    BLOCK_P = max(16, next_pow2(P))
    _argmax_reduce_kernel[(S,)](part, out, P, V, BLOCK_P=BLOCK_P, num_warps=1 if BLOCK_P <= 128 else 4)
    return out


_TRITON_FAILED = False


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """[S, V] float logits -> [S] int64, equal to logits.argmax(dim=-1); see the module docstring.

    CUDA tensors with fewer than TORCH_MIN_ROWS rows take the Triton kernel; everything else (CPU, many
    rows, GYRFALCON_KERNELS=ref) takes torch's argmax. Every greedy step goes through here: if the kernel
    cannot be built on this GPU, torch's argmax takes over with a warning rather than failing steps."""
    global _TRITON_FAILED
    if (use_triton(logits) and not _TRITON_FAILED and logits.dim() == 2
            and argmax_launch(logits.shape[0], logits.shape[1]) is not None):
        try:
            return greedy_argmax_triton(logits)
        except Exception as e:  # compilation / launch failure, not a data error
            _TRITON_FAILED = True
            logging.getLogger(__name__).warning("Triton argmax kernel unavailable (%s: %s); using torch's "
                                                "argmax", type(e).__name__, e)
    return greedy_argmax_ref(logits)
