"""Shared helpers for the kernels package: Triton availability and the ref/Triton dispatch rule."""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (CPU tests). The interpreter's tl.dot mishandles bf16 operands
    (it stores bf16 as uint16), so attention kernels upcast dot operands to fp32 there."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Triton is optional: the CPU path runs on the plain-torch references alone. A CPU-only torch build
# never dispatches to Triton, so triton is imported only for GPU builds or the interpreter: that keeps
# CPU imports light and leaves tests free to switch the interpreter on before triton's first import
# (triton builds its own @jit helpers in one mode or the other at import time).
_WANT_TRITON = torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None or interpreting()
triton = None
tl = None
HAS_TRITON = False
if _WANT_TRITON:
    try:
        import triton
        import triton.language as tl

        HAS_TRITON = True
    except Exception:  # pragma: no cover - depends on the install
        triton = None
        tl = None


def use_triton(t: torch.Tensor) -> bool:
    """True when `t` lives on a CUDA device, Triton imports and GYRFALCON_KERNELS != "ref".

    The env var is read on every call (it is cheap) so tests and benchmarks can flip it at run time.
    """
    return HAS_TRITON and t.is_cuda and os.environ.get("GYRFALCON_KERNELS") != "ref"


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (and >= 1); Triton block shapes must be powers of two."""
    return 1 << max(0, (int(n) - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
