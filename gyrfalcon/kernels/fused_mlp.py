"""A batch-1 decoder layer's whole MLP in one launch: [residual add +] RMSNorm -> gate_up -> SiLU-and-mul ->
down_proj.

Why: at batch 1 a small model's decode step is a chain of dependent launches, not a stream of bytes
(README: Qwen3-0.6B's 28 layers take ~20 us a layer even with their weights in L2, ~3.4 us a launch). The
MLP needs no grid-wide barrier between its two GEMVs, because SiLU-and-mul is element-wise over the
intermediate dimension: a program that owns BLOCK_I intermediate units computes their gate and up rows
(every input), their activation, and their share of down_proj's output, down_proj's columns [H, BLOCK_I]
times those BLOCK_I activations, a partial [H] summed into an fp32 accumulator with atomic adds. The last
program to arrive (an arrival counter, as split-K in small_m_gemv) rounds the sum to the activation dtype,
stores it, and zeroes the accumulator and the counter for the next launch. One launch instead of two, and
under PDL every weight byte a program needs first (its gate / up tiles and its first down_proj tile) loads
before the wait.

Shapes: x, residual [1, H]; norm_weight [H]; w_gate_up [2 * I, H] (gate rows first, as MergedLinear stores
them); w_down [H, I]. Returns (y [1, H] = down(silu(gate) * up), new_residual [1, H] = x + residual).

Numerics: the same roundings as norm_gemv (silu_mul) followed by norm_gemv on down_proj (x + residual
rounded once, the normalized row rounded to the weight dtype, gate and up rounded before the activation,
the activation rounded before down_proj, down_proj's fp32 sum rounded once); only the order of down_proj's
fp32 sum differs, and it is not fixed: atomic adds land in arrival order, so two runs can differ in the
last bit of an output. Off by default (GYRFALCON_FUSED_MLP=1): it lost on the H200 (run 73,
latency_*_b1_mlp_*-h200-2026-12-02-run73.json, mlp_chain-h200-2026-12-02-run73.json). Its GPU tests pass, but
Qwen3-0.6B batch 1 ran 0.805 / 0.804 ms a step against 0.702 / 0.701 with two launches (ABAB; 0.882 at BLOCK_I 16,
192 programs), Llama-3.1-8B batch 1 4.882 against 4.172; the 28-layer Qwen3-0.6B chain (`small_m_gemv.py
--mlp-chain`) 725.3 us a step at the default BLOCK_I 32 / 8 warps, 813.5-1271.3 at the other five launch shapes,
against 628.5 with two launches. With at most one program an SM, half of each program's gate / up tiles and of its
down_proj columns load after the wait (its 96 KB before it fill the registers), and 96 programs' 1,024 atomic adds
each land on the same 1,024 addresses; the two launches it replaces spread the same bytes over 768 + 128 programs
that all load before their waits.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional, Tuple

import torch

from gyrfalcon.kernels._common import (HAS_TRITON, cdiv, gdc_launch_dependents, gdc_wait, next_pow2,
                                       pdl_launch_kwargs, sm_count, tl, triton, use_pdl, use_triton)
from gyrfalcon.kernels.small_m_gemv import norm_gemv_ref


def fused_mlp_enabled() -> bool:
    """GYRFALCON_FUSED_MLP=1: batch-1 decode layers run their MLP through this kernel (off by default)."""
    return os.environ.get("GYRFALCON_FUSED_MLP", "0") == "1"


def fused_mlp_ref(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, w_gate_up: torch.Tensor,
                  w_down: torch.Tensor, eps: float = 1e-6) -> Tuple[torch.Tensor, torch.Tensor]:
    """The unfused composition: residual add + RMSNorm + gate_up + SiLU-and-mul, then down_proj."""
    act, new_residual = norm_gemv_ref(x, w_gate_up, norm_weight, residual, eps, silu_mul=True)
    return norm_gemv_ref(act, w_down)[0], new_residual


class FusedMlpConfig(NamedTuple):
    """BLOCK_I intermediate units a program; BLOCK_K inputs a gate / up tile; BLOCK_H outputs a down_proj tile."""
    block_i: int
    block_k: int
    block_h: int
    num_warps: int


GATE_UP_TILE_BYTES = 64 * 1024  # a program's gate + up tiles before the wait: half a 1024-wide row at BLOCK_I 32
DOWN_TILE_BYTES = 32 * 1024  # its first down_proj tile [BLOCK_H, BLOCK_I]: half of H = 1024 at BLOCK_I 32


def fused_mlp_config(H: int, I: int, elem_size: int, sms: int) -> FusedMlpConfig:
    """At most one program an SM (Qwen3-0.6B: BLOCK_I 32, 96 programs; Llama-3.1-8B: 128, 112), so that every
    program is resident from the start: what loads before the wait (up to 96 KB, in registers) holds 245-255
    registers a thread at 8 warps (scripts/compile_check.py, sm_90), one program an SM. Tiles sized to those
    bytes. GYRFALCON_FUSED_MLP_BLOCK_I overrides BLOCK_I (launch-shape experiments)."""
    env = os.environ.get("GYRFALCON_FUSED_MLP_BLOCK_I")
    block_i = int(env) if env else min(128, max(16, next_pow2(cdiv(I, sms))))
    block_k = min(next_pow2(H), max(64, _prev_pow2(GATE_UP_TILE_BYTES // (2 * block_i * elem_size))))
    block_h = min(next_pow2(H), max(16, _prev_pow2(DOWN_TILE_BYTES // (block_i * elem_size))))
    return FusedMlpConfig(block_i, block_k, block_h, 8)


def _prev_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


if HAS_TRITON:

    @triton.jit
    def _x_res_tile(x_ptr, r_ptr, r_out_ptr, kk, kmask, write_res):
        """Inputs kk of the row: x + residual, added in fp32 and rounded once to the activation dtype, as the
        unfused add does; write_res: also store them as the new residual."""
        xk = tl.load(x_ptr + kk, mask=kmask, other=0.0)
        rk = tl.load(r_ptr + kk, mask=kmask, other=0.0)
        xk = (xk.to(tl.float32) + rk.to(tl.float32)).to(x_ptr.dtype.element_ty)
        if write_res:
            tl.store(r_out_ptr + kk, xk, mask=kmask)
        return xk

    @triton.jit
    def _fused_mlp_kernel(x_ptr, r_ptr, nw_ptr, wgu_ptr, wd_ptr, y_ptr, r_out_ptr, acc_ptr, cnt_ptr,
                          H, I, stride_wgu, stride_wd, eps,
                          BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr,
                          BLOCK_H: tl.constexpr, NORM_BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
        # Grid: (cdiv(I, BLOCK_I),). Program p owns intermediate units ii = [p * BLOCK_I, +BLOCK_I): gate rows
        # ii and up rows I + ii of w_gate_up, columns ii of w_down.
        pid = tl.program_id(0)
        ii = pid * BLOCK_I + tl.arange(0, BLOCK_I)
        imask = ii < I
        ks = tl.arange(0, BLOCK_K)
        hs = tl.arange(0, BLOCK_H)
        # Nothing here depends on the previous kernel: under PDL these loads overlap its tail.
        kmask0 = ks < H
        wm0 = imask[:, None] & kmask0[None, :]
        wg0 = tl.load(wgu_ptr + ii[:, None] * stride_wgu + ks[None, :], mask=wm0, other=0.0)
        wu0 = tl.load(wgu_ptr + (ii[:, None] + I) * stride_wgu + ks[None, :], mask=wm0, other=0.0)
        nw0 = tl.load(nw_ptr + ks, mask=kmask0, other=0.0).to(tl.float32)
        hmask0 = hs < H
        wd0 = tl.load(wd_ptr + hs[:, None] * stride_wd + ii[None, :], mask=hmask0[:, None] & imask[None, :],
                      other=0.0)
        if USE_PDL:
            gdc_launch_dependents()
            gdc_wait()
        # rstd of the row (x + residual); program 0 stores the new residual on the way.
        kn = tl.arange(0, NORM_BLOCK)
        ss = 0.0
        for k0 in range(0, H, NORM_BLOCK):
            kk = k0 + kn
            xf = _x_res_tile(x_ptr, r_ptr, r_out_ptr, kk, kk < H, pid == 0).to(tl.float32)
            ss += tl.sum(xf * xf, axis=0)
        rstd = 1.0 / tl.sqrt(ss / H + eps)
        xn = (_x_res_tile(x_ptr, r_ptr, r_out_ptr, ks, kmask0, False).to(tl.float32) * rstd * nw0)
        xn = xn.to(wgu_ptr.dtype.element_ty).to(tl.float32)
        acc_g = tl.sum(wg0.to(tl.float32) * xn[None, :], axis=1)
        acc_u = tl.sum(wu0.to(tl.float32) * xn[None, :], axis=1)
        for k0 in range(BLOCK_K, H, BLOCK_K):
            kk = k0 + ks
            kmask = kk < H
            wm = imask[:, None] & kmask[None, :]
            wg = tl.load(wgu_ptr + ii[:, None] * stride_wgu + kk[None, :], mask=wm, other=0.0)
            wu = tl.load(wgu_ptr + (ii[:, None] + I) * stride_wgu + kk[None, :], mask=wm, other=0.0)
            nw = tl.load(nw_ptr + kk, mask=kmask, other=0.0).to(tl.float32)
            xn = _x_res_tile(x_ptr, r_ptr, r_out_ptr, kk, kmask, False).to(tl.float32) * rstd * nw
            xn = xn.to(wgu_ptr.dtype.element_ty).to(tl.float32)
            acc_g += tl.sum(wg.to(tl.float32) * xn[None, :], axis=1)
            acc_u += tl.sum(wu.to(tl.float32) * xn[None, :], axis=1)
        # SiLU-and-mul with the unfused path's roundings (gate_up's output, then the activation, stored in the
        # activation dtype there). Units past I have zero weights, so zero activations.
        g = acc_g.to(y_ptr.dtype.element_ty).to(tl.float32)
        u = acc_u.to(y_ptr.dtype.element_ty).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g)) * u).to(y_ptr.dtype.element_ty).to(tl.float32)
        # This program's share of down_proj: w_down[:, ii] @ act, added into the fp32 accumulator.
        tl.atomic_add(acc_ptr + hs, tl.sum(wd0.to(tl.float32) * act[None, :], axis=1), mask=hmask0, sem="relaxed")
        for h0 in range(BLOCK_H, H, BLOCK_H):
            hh = h0 + hs
            hmask = hh < H
            wd = tl.load(wd_ptr + hh[:, None] * stride_wd + ii[None, :], mask=hmask[:, None] & imask[None, :],
                         other=0.0)
            tl.atomic_add(acc_ptr + hh, tl.sum(wd.to(tl.float32) * act[None, :], axis=1), mask=hmask,
                          sem="relaxed")
        # Every thread's adds issued before the release; the last program to arrive reads the sums from L2 (.cg)
        # after its acquire, stores y, and leaves the accumulator and the counter at zero.
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr, 1, sem="acq_rel")
        if done == tl.num_programs(0) - 1:
            for h0 in range(0, H, BLOCK_H):
                hh = h0 + hs
                hmask = hh < H
                v = tl.load(acc_ptr + hh, mask=hmask, other=0.0, cache_modifier=".cg")
                tl.store(y_ptr + hh, v.to(y_ptr.dtype.element_ty), mask=hmask)
                tl.store(acc_ptr + hh, tl.zeros([BLOCK_H], dtype=tl.float32), mask=hmask)
            tl.store(cnt_ptr, 0)


MAX_HIDDEN = 1 << 16  # the accumulator's length (never reallocated: CUDA graphs hold it)
_WORKSPACES: dict = {}


def _workspace(device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """The zeroed fp32 accumulator [MAX_HIDDEN] and int32 arrival counter, allocated once per device (a decode
    graph's first call runs eagerly before its capture) and left at zero by every launch. Launches on one
    stream share them; two streams running this kernel at once would not."""
    key = (device.type, device.index)
    if key not in _WORKSPACES:
        _WORKSPACES[key] = (torch.zeros(MAX_HIDDEN, dtype=torch.float32, device=device),
                            torch.zeros(1, dtype=torch.int32, device=device))
    return _WORKSPACES[key]


def fused_mlp_triton(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, w_gate_up: torch.Tensor,
                     w_down: torch.Tensor, eps: float = 1e-6, config: Optional[FusedMlpConfig] = None,
                     pdl: Optional[bool] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Same contract as fused_mlp_ref for one row; no host sync. pdl: launch with programmatic dependent launch
    (default use_pdl(x)). config overrides fused_mlp_config (tests, sweeps)."""
    M, H = x.shape
    I = w_down.shape[1]
    assert M == 1, "fused_mlp takes one row"
    assert H <= MAX_HIDDEN and w_gate_up.shape == (2 * I, H) and w_down.shape == (H, I)
    assert x.stride(-1) == 1 and residual.stride(-1) == 1 and w_gate_up.stride(-1) == 1 and w_down.stride(-1) == 1
    y = torch.empty(1, H, dtype=x.dtype, device=x.device)
    r_out = torch.empty_like(x)
    acc, cnt = _workspace(x.device)
    pdl = use_pdl(x) if pdl is None else pdl
    cfg = config or fused_mlp_config(H, I, w_gate_up.element_size(), sm_count(x.device, 16))
    _fused_mlp_kernel[(triton.cdiv(I, cfg.block_i),)](
        x, residual, norm_weight, w_gate_up, w_down, y, r_out, acc, cnt,
        H, I, w_gate_up.stride(0), w_down.stride(0), float(eps),
        BLOCK_I=cfg.block_i, BLOCK_K=cfg.block_k, BLOCK_H=cfg.block_h,
        NORM_BLOCK=min(next_pow2(H), 8192), USE_PDL=pdl, num_warps=cfg.num_warps, num_stages=1,
        **pdl_launch_kwargs(pdl),
    )
    return y, r_out


def fused_mlp(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, w_gate_up: torch.Tensor,
              w_down: torch.Tensor, eps: float = 1e-6) -> Tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x) and x.shape[0] == 1:
        return fused_mlp_triton(x, residual, norm_weight, w_gate_up, w_down, eps)
    return fused_mlp_ref(x, residual, norm_weight, w_gate_up, w_down, eps)
