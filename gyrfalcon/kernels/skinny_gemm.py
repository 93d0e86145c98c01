"""Stream-K GEMM for decode-sized batches: y [M, N] = x [M, K] @ W [N, K]^T (+ add_to), M up to 128 rows.

At 16-128 rows a decoder layer's GEMMs are a stream over the weight (Llama-3.1-8B: 436 MB a layer against
~0.5 MB of activations), and cuBLAS reaches 68-89% of the H200's HBM bandwidth on them inside a decode graph
(latency_llama-3.1-8b_b64_fold1_*-h200-2026-12-01-run48.json, batch 64: qkv 16.6 us for 50 MB, o_proj 11.9 us
for 34 MB, down_proj 33.1 us + a 2.7 us split-K reduce for 117 MB, gate_up 63.5 us for 235 MB). Its tiles
leave SMs idle where the output has few column tiles (qkv: 96 CTAs, o_proj: 128 on 132 SMs) and add a reduce
launch where it splits K.

Here the grid is one program per SM (`programs`) and the work is cut evenly in K steps, not in tiles
(stream-K): the weight's BLOCK_N-row tiles times their K / BLOCK_K steps form one sequence of iterations,
and program p runs iterations [p T / P, (p + 1) T / P) of it, so every SM streams the same number of
weight bytes whatever the shape. A program's range covers whole tiles (stored directly) and at most two
partial ones (its first and its last): each partial accumulator goes to a workspace slot, and the program
that completes a tile's K steps (an arrival counter counting K steps) sums the others' partials and stores
the tile, then resets the counter (CUDA-graph replays find it zero). No second launch.

Each step is a tensor-core dot of a weight tile [BLOCK_N, BLOCK_K] with the input tile transposed
[BLOCK_K, BLOCK_M] (the weight's rows are the dot's long side, as cuBLAS's "swap AB" does for skinny
problems), so the accumulator is y^T's tile [BLOCK_N, BLOCK_M]; the input tiles come from L2 (every program
reads the rows of x for its K range; large BLOCK_N keeps those re-reads small next to the weight).

Measured on the H200 (run 50, benchmarks/skinny_gemm.py; skinny_gemm-h200-2026-12-01-run50.json): slower than
cuBLAS on every decode shape, so no model routes rows here by default. Llama-3.1-8B's four layer GEMMs at 16
rows 133.7 us vs cuBLAS's 124.1 (gate_up 62.0 vs 59.8, qkv 19.2 vs 16.2), at 64 rows 150.3 (the sweep's best
launch shapes: 142.0) vs 129.7, at 128 rows 240.5 vs 137.4; Qwen3-0.6B's 2-4x slower, a fixed ~10 us a launch
(with ~1 K step a program, most likely the pipeline's fill and the tile's serial sum of up to 15 partials;
not profiled).
Whole decode steps, same call: Llama-8B batch 64 5.99 / 5.99 ms vs 5.27 / 5.22, batch 16 4.757 vs 4.651
(latency_llama-3.1-8b_b*_skinny*-h200-2026-12-01-run50.json). Left for a TMA / warp-specialized version; the
partial-tile sum could load all contributors at once instead of one after another.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from gyrfalcon.kernels._common import HAS_TRITON, cdiv, interpreting, next_pow2, sm_count, tl, triton
from gyrfalcon.kernels.small_m_gemv import _split_counters

MAX_ROWS = 128  # rows one program's input tile holds (BLOCK_M)


def skinny_gemm_rows() -> int:
    """Rows up to which a linear layer without a bias runs this kernel instead of cuBLAS (above the rows the
    small-M GEMV takes): GYRFALCON_SKINNY_GEMM_ROWS, at most MAX_ROWS; 0 (off: slower than cuBLAS, run 50)."""
    return max(0, min(MAX_ROWS, int(os.environ.get("GYRFALCON_SKINNY_GEMM_ROWS", "0"))))


def skinny_gemm_ref(x: torch.Tensor, weight: torch.Tensor, add_to: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The plain composition: F.linear, then (add_to) the in-place add, rounded once as cuBLAS's beta = 1
    (the sum in fp32, then the activation dtype)."""
    if add_to is None:
        return F.linear(x, weight)
    y = (add_to.float() + F.linear(x.float(), weight.float())).to(add_to.dtype)
    return add_to.copy_(y)


class SkinnyConfig(NamedTuple):
    """Launch shape: BLOCK_N weight rows and BLOCK_K inputs a step, programs (0: one per SM)."""
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    programs: int = 0


SMEM_BUDGET = 160 * 1024  # bytes of pipelined tiles a program may hold (of the H200's 227 KB a block)


def default_config(M: int, N: int, K: int, elem_size: int = 2) -> SkinnyConfig:
    """A launch shape from the problem shape only (CUDA-graph safe). 128-row weight tiles (the input's
    re-reads from L2 are BLOCK_M / BLOCK_N of the weight's bytes), 128 inputs a step, as many stages as
    SMEM_BUDGET holds (4 at 16 rows, 3 at 64, 2 at 128: at least ~64 KB of weight in flight per SM, twice
    what the HBM's latency-bandwidth product asks of each SM). GYRFALCON_SKINNY_CONFIG="block_n,block_k,
    warps,stages" overrides it (benchmark sweeps)."""
    env = os.environ.get("GYRFALCON_SKINNY_CONFIG")
    if env:
        bn, bk, nw, ns = (int(v) for v in env.split(","))
        return SkinnyConfig(bn, bk, nw, ns)
    bm = max(16, next_pow2(M))
    bn, bk = 128, min(128, max(16, next_pow2(K)))
    stage = (bn + bm) * bk * elem_size
    ns = max(1, min(4, SMEM_BUDGET // stage))
    return SkinnyConfig(bn, bk, 8 if bm >= 64 else 4, ns)


if HAS_TRITON:

    @triton.jit
    def _skinny_epilogue(acc, y_ptr, cols, rows, N, M, stride_y, ADD_OUT: tl.constexpr):
        """Store y^T's tile acc [BLOCK_N, BLOCK_M] into y [M, N] (ADD_OUT: added to what y holds, in fp32,
        rounded once; each tile has one writer, so in place is safe)."""
        ptrs = y_ptr + rows[None, :] * stride_y + cols[:, None]
        omask = (cols[:, None] < N) & (rows[None, :] < M)
        if ADD_OUT:
            acc += tl.load(ptrs, mask=omask, other=0.0).to(tl.float32)
        tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=omask)

    @triton.jit
    def _skinny_gemm_kernel(
        x_ptr, w_ptr, y_ptr, ws_ptr, cnt_ptr,
        M, N, K, stride_x, stride_w, stride_y, total_iters, iters_per_tile,
        ADD_OUT: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        pid = tl.program_id(0)
        P = tl.num_programs(0)
        # This program's K steps of the whole problem: [start, end) (64-bit: T * P can pass 2^31).
        tot = (total_iters + P * 0).to(tl.int64)  # a tensor even where Triton passes total_iters == 1 as a constant
        P64 = tot * 0 + P
        start = (pid * tot // P64).to(tl.int32)
        end = ((pid + 1) * tot // P64).to(tl.int32)
        rows = tl.arange(0, BLOCK_M)
        rmask = rows < M
        ks = tl.arange(0, BLOCK_K)
        first_tile = start // iters_per_tile
        n_segs = tl.where(end > start, (end - 1) // iters_per_tile - first_tile + 1, 0)
        for seg in range(0, n_segs):
            tile = first_tile + seg
            t0 = tile * iters_per_tile
            k0 = tl.maximum(start, t0) - t0  # this segment's K steps of the tile: [k0, k1)
            k1 = tl.minimum(end, t0 + iters_per_tile) - t0
            cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            cmask = cols < N
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for kstep in range(k0, k1):
                kk = kstep * BLOCK_K + ks
                kmask = kk < K
                w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_w + kk[None, :],
                            mask=cmask[:, None] & kmask[None, :], other=0.0)
                xk = tl.load(x_ptr + rows[:, None] * stride_x + kk[None, :], mask=rmask[:, None] & kmask[None, :],
                             other=0.0)
                if UPCAST:  # the interpreter's dot mishandles 16-bit operands
                    acc += tl.dot(w.to(tl.float32), tl.trans(xk.to(tl.float32)))
                else:
                    acc += tl.dot(w, tl.trans(xk.to(w.dtype)), input_precision=DOT_PREC)
            if (k0 == 0) & (k1 == iters_per_tile):
                _skinny_epilogue(acc, y_ptr, cols, rows, N, M, stride_y, ADD_OUT)
            else:
                # A partial tile: to this program's slot (0: its first segment, 1: its last), then the arrival
                # counter by K steps; every thread's stores are done (barrier) before the release atomic, and
                # the program that brings the count to iters_per_tile reads the others' slots (.cg: from L2).
                tile_elems = BLOCK_N * BLOCK_M
                offs = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + rows[None, :]
                slot = pid * 2 + tl.where(seg == 0, 0, 1)
                tl.store(ws_ptr + slot * tile_elems + offs, acc)
                tl.debug_barrier()
                done = tl.atomic_add(cnt_ptr + tile, k1 - k0, sem="acq_rel") + (k1 - k0)
                if done == iters_per_tile:
                    tl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next launch (or graph replay)
                    # The tile's other contributors: the owners of its first and last K steps, and all between
                    # (owner(i) = ((i + 1) P - 1) // T, the largest q with q T / P <= i).
                    q_lo = (((t0 + 1) * P64 - 1) // tot).to(tl.int32)
                    q_hi = (((t0 + iters_per_tile) * P64 - 1) // tot).to(tl.int32)
                    for q in range(q_lo, q_hi + 1):
                        if q != pid:
                            q_first = ((q * tot // P64) // iters_per_tile).to(tl.int32)
                            q_slot = q * 2 + tl.where(tile == q_first, 0, 1)
                            acc += tl.load(ws_ptr + q_slot * tile_elems + offs, cache_modifier=".cg")
                    _skinny_epilogue(acc, y_ptr, cols, rows, N, M, stride_y, ADD_OUT)


def skinny_gemm_triton(x: torch.Tensor, weight: torch.Tensor, add_to: Optional[torch.Tensor] = None,
                       config: Optional[SkinnyConfig] = None) -> torch.Tensor:
    """skinny_gemm_ref's contract for x [M <= MAX_ROWS, K] and weight [N, K] (K contiguous); no host sync.
    add_to [M, N]: the product is added to it in place and add_to returned (the residual add of folded
    norms). config overrides default_config (tests, benchmark sweeps)."""
    M, K = x.shape
    N = weight.shape[0]
    assert M <= MAX_ROWS, f"skinny_gemm handles at most {MAX_ROWS} rows, got {M}"
    assert x.stride(-1) == 1 and weight.stride(-1) == 1 and weight.shape[1] == K
    if add_to is not None:
        assert add_to.shape == (M, N) and add_to.dtype == x.dtype and add_to.stride(-1) == 1
        y = add_to
    else:
        y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    cfg = config or default_config(M, N, K, weight.element_size())
    bm = max(16, next_pow2(M))
    bn, bk = max(16, cfg.block_n), max(16, cfg.block_k)
    n_tiles, ipt = cdiv(N, bn), cdiv(K, bk)
    total = n_tiles * ipt
    programs = max(1, min(cfg.programs or sm_count(x.device, 4), total))
    # Two partial-tile slots a program ([programs * 2, BLOCK_N, BLOCK_M] fp32; inside a graph, its pool's),
    # one arrival counter a column tile (zeroed once per device, left at zero by every launch).
    ws = torch.empty(programs * 2 * bn * bm, dtype=torch.float32, device=x.device)
    cnt = _split_counters(x.device, n_tiles)
    _skinny_gemm_kernel[(programs,)](
        x, weight, y, ws, cnt, M, N, K, x.stride(0), weight.stride(0), y.stride(0), total, ipt,
        ADD_OUT=add_to is not None, UPCAST=interpreting(),
        DOT_PREC="ieee" if weight.dtype == torch.float32 else "tf32",
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y
