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

import torch

from gyrfalcon.kernels.argmax.configs import (BLOCK, MIN_CHUNK, NUM_WARPS, TARGET_PROGRAMS, TORCH_MIN_ROWS,
                                              argmax_launch, split_rows)
from gyrfalcon.kernels.argmax.naive import greedy_argmax_ref
from gyrfalcon.kernels.argmax.triton import greedy_argmax_triton
from gyrfalcon.kernels.common import use_triton


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


__all__ = ["BLOCK", "MIN_CHUNK", "NUM_WARPS", "TARGET_PROGRAMS", "TORCH_MIN_ROWS", "argmax_launch", "greedy_argmax",
           "greedy_argmax_ref", "greedy_argmax_triton", "split_rows"]
