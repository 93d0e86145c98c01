"""Pull a tensor's bytes into the GPU's L2 cache ahead of the kernel that reads them.

A batched decode step (Llama-3.1-8B at 16-64 sequences) reads its weights from HBM at 70-98% of the
bandwidth in every GEMM, but decode attention between qkv_proj and o_proj is latency-bound: at ~190 tokens of
context it reads its K/V at ~1-2.7 TB/s (README: 11.8 us a layer at batch 16, 17.3 at batch 64), leaving about
one o_proj's worth of HBM time idle (Llama-3.1-8B's o_proj: 33.5 MB, 8 us at 4.15 TB/s; the H200's L2 holds 50 MB).
l2_prefetch issues `prefetch.global.L2::evict_last` for every 128-byte line of the tensor: fire and forget,
nothing waits for the data, and the evict-last priority keeps the lines while attention's K/V streams through.
Run on a side branch of the decode graph beside attention (layers/side_prefetch.py), o_proj then reads its weight
from L2.

It has no result, so its reference is a no-op (l2_prefetch_ref), and it is a no-op wherever it cannot run: off
CUDA, under the interpreter (no PTX), on ROCm.
"""

from __future__ import annotations

import torch

from gyrfalcon.kernels._common import HAS_TRITON, interpreting, tl, triton

LINE = 128  # bytes a prefetch covers (an L2 cache line)
LINES_PER_PROGRAM = 1024  # 128 KB a program: Llama-3.1-8B's o_proj is 256 programs
LANES = 256  # lines a loop step issues (8 a thread of the program's one warp)


def l2_prefetch_ref(t: torch.Tensor) -> None:
    """Reference: a prefetch changes no value, so there is nothing to compute."""
    return None


if HAS_TRITON:
    @triton.jit
    def _l2_prefetch_kernel(base_ptr, n_lines, LINES_PER_PROG: tl.constexpr, BLOCK: tl.constexpr,
                            ASM: tl.constexpr):
        """Program p prefetches lines [p * LINES_PER_PROG, (p + 1) * LINES_PER_PROG) of the region (clipped) with
        the prefetch statement ASM (_PREFETCH_ASM: evict-last or normal priority)."""
        lo = tl.program_id(0) * LINES_PER_PROG
        hi = tl.minimum(lo + LINES_PER_PROG, n_lines)
        b8 = base_ptr.to(tl.pointer_type(tl.int8))
        for i0 in range(lo, hi, BLOCK):
            # Past the end, lanes repeat the last line (an asm statement takes no mask).
            idx = tl.minimum(i0 + tl.arange(0, BLOCK), hi - 1)
            tl.inline_asm_elementwise(ASM, "=r,l", [b8 + idx.to(tl.int64) * 128], dtype=tl.int32, is_pure=False,
                                      pack=1)


_PREFETCH_ASM = {True: "prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;",
                 False: "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;"}


def l2_prefetch_launch(nbytes: int, lines_per_program: int = LINES_PER_PROGRAM) -> tuple:
    """(lines, programs) of a prefetch over nbytes."""
    lines = -(-nbytes // LINE)
    return lines, -(-lines // lines_per_program)


def l2_prefetch_triton(t: torch.Tensor, lines_per_program: int = LINES_PER_PROGRAM, evict_last: bool = True) -> None:
    """The launch: one warp a program, so that its programs fit beside a running kernel's. t: contiguous."""
    if not t.is_contiguous():
        raise ValueError("l2_prefetch needs a contiguous tensor")
    lines, programs = l2_prefetch_launch(t.numel() * t.element_size(), lines_per_program)
    if lines:
        _l2_prefetch_kernel[(programs,)](t, lines, LINES_PER_PROG=lines_per_program, BLOCK=LANES,
                                         ASM=_PREFETCH_ASM[bool(evict_last)], num_warps=1)


def l2_prefetch(t: torch.Tensor, evict_last: bool = True) -> None:
    """Prefetch contiguous tensor t into L2 (evict-last unless evict_last=False) in the current stream; a no-op
    where the kernel cannot run (see the module docstring)."""
    if HAS_TRITON and t.is_cuda and not interpreting() and getattr(torch.version, "hip", None) is None:
        l2_prefetch_triton(t, evict_last=evict_last)
    else:
        l2_prefetch_ref(t)
