"""Shared helpers of the kernel folders: Triton availability, the ref/Triton dispatch rule, programmatic dependent
launch, launch-shape arithmetic and device properties."""

from __future__ import annotations

import os

import torch

from gyrfalcon import envs


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (CPU tests; Triton's own variable, read here because the choice to import
    triton at all depends on it). The interpreter's tl.dot mishandles bf16 operands (it stores bf16 as uint16),
    so attention kernels upcast dot operands to fp32 there."""
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
    """True when `t` lives on a CUDA device, Triton imports and GYRFALCON_KERNELS is not "ref" (envs)."""
    return HAS_TRITON and t.is_cuda and envs.get().kernels != "ref"


# Programmatic dependent launch (Hopper+): a kernel launched with it may start while the previous kernel
# in the stream is still running, do the work that does not depend on it (load weights), then wait in
# gdc_wait() for that kernel to finish and its writes to be visible. In a decode step of ~200 small
# kernels this overlaps each kernel's start-up latency with its predecessor's tail. Every program of such
# a kernel must call gdc_wait() before it reads anything an earlier kernel wrote, and at least one program
# of each launch must call it before exiting (so that "this kernel complete => the previous one complete"
# stays transitive down the chain); a program that reads and writes nothing of the chain's may exit
# without it (decode attention's empty splits do, when it prefetches).
gdc_wait = gdc_launch_dependents = None
if HAS_TRITON:
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F811
    except Exception:  # pragma: no cover - older Triton
        gdc_wait = gdc_launch_dependents = None
_PDL_DEVICES: dict = {}
_PDL_WARMUP = [False]


class pdl_warmup:
    """Within this block use_pdl() answers as if a CUDA graph were being captured, so that the eager
    warm-up run before a capture compiles (and loads) the same kernel variants that the capture records."""

    def __enter__(self):
        self._prev = _PDL_WARMUP[0]
        _PDL_WARMUP[0] = True

    def __exit__(self, *exc):
        _PDL_WARMUP[0] = self._prev


_PDL_OFF = [False]


class pdl_disabled:
    """Within this block use_pdl() is False: the runner captures a batch-1 decode graph both ways and
    keeps the faster (see runner/cuda_graph.py)."""

    def __enter__(self):
        self._prev = _PDL_OFF[0]
        _PDL_OFF[0] = True

    def __exit__(self, *exc):
        _PDL_OFF[0] = self._prev


def pdl_mode() -> str:
    """GYRFALCON_PDL (envs): "auto" (default: the runner times its batch-1 decode graph with and without PDL
    at startup and keeps the faster), "1" (always where use_pdl allows), "0" (never), "serial" (see
    pdl_launch_kwargs)."""
    return envs.get().pdl


def use_pdl(t: torch.Tensor) -> bool:
    """True when a kernel on `t` should launch with programmatic dependent launch: it is being captured
    into a CUDA graph, for a single row (a batch-1 decode step: t's first dimension is 1), on a device of
    compute capability >= 9.0, with a Triton that has grid-dependency control, not under the
    interpreter, not inside pdl_disabled(), and GYRFALCON_PDL is not "0" ("serial": see pdl_launch_kwargs).

    Why only there: in batch-1 decode graphs it overlaps each small kernel's start with its predecessor's
    tail; in eager prefills and in the batched graphs (attention, o_proj / down_proj GEMVs) it was slower on
    the H200 (docs/performance.md). Whether it pays even at batch 1 depends on the model, hence the runner's
    timed choice (pdl_mode "auto")."""
    if t.dim() == 0 or t.shape[0] != 1 or not pdl_possible(t):
        return False
    return _PDL_WARMUP[0] or torch.cuda.is_current_stream_capturing()


def pdl_possible(t: torch.Tensor) -> bool:
    """use_pdl's conditions on the device, the Triton build and the settings (not on the launch)."""
    if gdc_wait is None or not t.is_cuda or interpreting() or _PDL_OFF[0] or envs.get().pdl == "0":
        return False
    idx = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if idx not in _PDL_DEVICES:
        _PDL_DEVICES[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return _PDL_DEVICES[idx]


def pdl_launch_kwargs(pdl: bool) -> dict:
    """Extra launch keywords for a kernel compiled with USE_PDL=pdl. GYRFALCON_PDL=serial launches the
    same kernel variants without the attribute: gdc_wait / gdc_launch_dependents are then no-ops and the
    kernels run one after another, with the same arithmetic (the tests' reference for PDL races)."""
    return {"launch_pdl": True} if pdl and envs.get().pdl != "serial" else {}


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (and >= 1); Triton block shapes must be powers of two."""
    return 1 << max(0, (int(n) - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


_SM_COUNT: dict = {}


def sm_count(device: torch.device, cpu_default: int) -> int:
    """Streaming multiprocessors of a CUDA device (cached per device); cpu_default elsewhere (the interpreter's
    tests, which size grids from it)."""
    if device.type != "cuda":
        return cpu_default
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


# Bytes of shared memory a program (thread block) may opt into on the H200 (sm_90): Triton's bound at compile time
# there, and what max_shared_mem answers off CUDA, so that the interpreter's tests pick launches as the H200 does.
H200_MAX_SHARED = 232448
_MAX_SHARED: dict = {}


def max_shared_mem(device: torch.device) -> int:
    """Bytes of shared memory one program may use on `device` (Triton's driver property, which its launches are
    checked against; cached per device); H200_MAX_SHARED off CUDA. Launch shapes tuned on the H200 that need more
    than a smaller card has (sm_86 / sm_89 / sm_120: ~99 KB, A100: ~163 KB) are cut or not chosen against it."""
    if device.type != "cuda":
        return H200_MAX_SHARED
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _MAX_SHARED:
        from triton.runtime import driver

        _MAX_SHARED[idx] = int(driver.active.utils.get_device_properties(idx)["max_shared_mem"])
    return _MAX_SHARED[idx]


# The op modules in an order where each comes after those it imports from (reload_kernel_modules).
KERNEL_MODULES = (
    "rms_norm.naive", "rms_norm.triton", "rms_norm",
    "rotary.naive", "rotary.triton", "rotary",
    "store_kv.naive", "store_kv.triton", "store_kv",
    "activation.naive", "activation.triton", "activation",
    "embedding.naive", "embedding.triton", "embedding",
    "argmax.configs", "argmax.naive", "argmax.triton", "argmax",
    "sampling.naive", "sampling.triton", "sampling",
    "fused_qkv_prep.naive", "fused_qkv_prep.configs", "fused_qkv_prep.triton", "fused_qkv_prep",
    "paged_attention.naive", "paged_attention.configs", "paged_attention.triton", "paged_attention",
    "decode_attention.naive", "decode_attention.configs", "decode_attention.tiles", "decode_attention.reduce",
    "decode_attention.split_kv", "decode_attention.with_prep", "decode_attention.launch", "decode_attention",
    "gemv.naive", "gemv.configs", "gemv.triton", "gemv",
    "fused_moe.naive", "fused_moe.configs", "fused_moe.triton", "fused_moe",
    "fp8_gemm.naive", "fp8_gemm.configs", "fp8_gemm.triton", "fp8_gemm",
    "moe_router.naive", "moe_router.triton", "moe_router",
    "mla_attention.naive", "mla_attention.triton", "mla_attention.expanded", "mla_attention",
    "dsa_indexer.naive", "dsa_indexer.triton", "dsa_indexer",
    "mla_prep.naive", "mla_prep.triton", "mla_prep",
    "gated_delta.naive", "gated_delta.configs", "gated_delta.triton_decode", "gated_delta.triton_conv",
    "gated_delta.triton_norm", "gated_delta.triton_chunk", "gated_delta.triton_position_states",
    "gated_delta.position_states", "gated_delta",
)


def reload_kernel_modules() -> dict:
    """Re-execute every op module (not this one), dependencies first, so that their @triton.jit functions are
    built again in the mode now in force (the tests' interpreter, or scripts/compile_check.py's compile-only
    harness after it patched this module's HAS_TRITON / triton / tl); then the package itself. Returns
    {"rms_norm": module, ...} for the op packages."""
    import importlib

    mods = {}
    for name in KERNEL_MODULES:
        mods[name] = importlib.reload(importlib.import_module("gyrfalcon.kernels." + name))
    importlib.reload(importlib.import_module("gyrfalcon.kernels"))
    return {k: v for k, v in mods.items() if "." not in k}
