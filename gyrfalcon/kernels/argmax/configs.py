"""The greedy argmax's launch shape (data and the rule that sizes the split from (S, V) alone)."""

from __future__ import annotations

from typing import Optional, Tuple

from gyrfalcon.kernels.common import cdiv


# Launch-shape constants. On the H200 (these defaults, hot cache) fp32 rows of 128,256 took 3.8 / 5.5 / 11.0 us
# at S = 1 / 16 / 64 against torch's 26.8 / 26.9 / 27.2; not swept further.
BLOCK = 4096           # elements per stage-1 iteration
NUM_WARPS = 8
MIN_CHUNK = 4096       # elements per stage-1 program, at least
TARGET_PROGRAMS = 512  # stage-1 programs to aim for when rows are few
TORCH_MIN_ROWS = 256   # from this many rows on, torch's argmax (see the module docstring)


def argmax_launch(S: int, V: int, block: int = BLOCK, min_chunk: int = MIN_CHUNK,
                  target_programs: int = TARGET_PROGRAMS) -> Optional[Tuple[int, int]]:
    """(chunk, P): elements per stage-1 program (a multiple of block) and programs per row; None when
    torch's argmax should run instead (S >= TORCH_MIN_ROWS)."""
    if S >= TORCH_MIN_ROWS:
        return None
    return split_rows(S, V, block, min_chunk, target_programs)


def split_rows(S: int, V: int, block: int, min_chunk: int, target_programs: int) -> Tuple[int, int]:
    P = max(1, min(cdiv(V, max(min_chunk, block)), cdiv(target_programs, max(S, 1))))
    chunk = cdiv(cdiv(V, P), block) * block
    return chunk, cdiv(V, chunk)
