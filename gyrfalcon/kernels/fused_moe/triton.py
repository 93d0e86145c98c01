"""The Triton fused MoE: token-to-expert sort with per-expert padding, a grouped gate_up GEMM with SiLU-and-mul in
its epilogue, a grouped down GEMM with the routing weights in its epilogue, and a per-token sum over the top k.

Four steps, no host sync (the sort runs on the device and every grid is sized from shapes alone, so the op can be
captured in a CUDA graph):
1. moe_align: the P = T * k (token, expert) pairs, pair id p = t * k + j, grouped by expert and each expert's group
   padded to a multiple of BLOCK_M rows; a padded row holds P ("none"). One tile of BLOCK_M sorted rows belongs to
   one expert; tiles past the last expert's are marked -1 and exit at once. Decode batches (P <=
   ALIGN_KERNEL_MAX_PAIRS) sort in one single-program kernel (_moe_align_kernel), larger ones with torch ops.
2. _moe_gate_up_kernel: tile x w13[e] -> silu(gate) * up, in x's dtype, into act [P, I] at the pair's row.
3. _moe_down_kernel: tile of act x w2[e] -> times the pair's routing weight, fp32, into y [P, H].
4. _moe_sum_kernel: out[t] = sum_j y[t * k + j], in a fixed order (deterministic), cast to x's dtype.

A decode batch reads only the selected experts' weights: an expert with no pairs owns no tile, and a tile past the
used ones reads its expert id (-1) and returns before touching any weight.

Expert parallelism (expert_start; layers/moe.py): w13 / w2 hold only this rank's E experts, global ids
[expert_start, expert_start + E), and topk_ids stay global. The sort drops every pair routed outside that range (it
gets no row), so the grouped GEMMs run this rank's pairs only, ~P / ep rows, and the top-k sum skips the dropped
pairs' y rows (never written). The grids keep their shape-only worst case (every pair local), so nothing reads the
local count back to the host and the op stays capturable; the tiles the dropped pairs would have filled are past the
used ones (-1) and exit at once. The launch shape is chosen for the rank's expected share of the pairs
(tuning_pairs, given total_experts).

FP8 experts (FP8 constexpr of both GEMM kernels; w13 / w2 float8_e4m3fn with (bn, bk) block scales, naive.py): the
K loop steps by BLOCK_K = bk, so one step meets one activation scale per row and one weight scale per output
column. Each step loads the A tile (x rows, or act rows for the down GEMM, in x's dtype), quantizes it to e4m3 per
row over that step (scale = amax / 448, as kernels/fp8_gemm does: the reference's per-token, per-bk-column groups),
runs the fp8 x fp8 dot with fp32 accumulation and adds it times x_scale[row] * w_scale[e, col // bn, step]; the
epilogues (rounding to x's dtype, SiLU-and-mul, routing weights) are the unquantized path's. The quantization is
recomputed by every N tile of a row block (cheap next to the weight tiles it meets; a separate act-quant launch
would cost more at decode sizes). Under the interpreter the e4m3 cast is emulated in fp32 (fp8_gemm's _round_e4m3)
and the dot runs on the fp8 operands' exact fp32 values. FP8 False compiles to the unquantized kernels unchanged
(the scale arguments are then unused).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from gyrfalcon.kernels.common import HAS_TRITON, cdiv, interpreting, next_pow2, tl, triton
from gyrfalcon.kernels.fp8_gemm import triton as fp8_triton  # _round_e4m3, looked up at launch (module reloads)
from gyrfalcon.kernels.fp8_gemm.naive import AMAX_FLOOR, FP8_MAX
from gyrfalcon.kernels.fused_moe.configs import ALIGN_KERNEL_MAX_PAIRS, MoeConfig, default_config, fp8_config
from gyrfalcon.kernels.fused_moe.naive import check_fp8_experts


def max_sorted_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the sorted, padded order, an upper bound from shapes only: each expert that has pairs pads at most
    block_m - 1 rows, and at most min(E, P) experts have pairs. A multiple of block_m."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return cdiv(bound, block_m) * block_m


def tuning_pairs(num_pairs: int, num_experts: int, total_experts: Optional[int] = None) -> int:
    """The pair count the launch shape is chosen for: all P pairs, or under expert parallelism (num_experts of
    total_experts held here) the share the router sends to them on average, P * E / total. The configs size tiles
    from pairs per expert; P over the local experts alone would count ep times too many (a prefill's 64-row tiles a
    quarter full at ep 4). From shapes only; the grids still cover every pair."""
    if total_experts is None or total_experts <= num_experts:
        return num_pairs
    return max(1, num_pairs * num_experts // total_experts)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int, one_launch: Optional[bool] = None,
              expert_start: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] int -> (sorted_ids [R] int32, tile_expert [R / block_m] int32), R = max_sorted_rows.

    sorted_ids: pair ids (t * k + j) grouped by expert in ascending expert order, pairs of one expert in ascending
    pair order, each expert's group starting at a multiple of block_m; padding rows hold P = T * k. tile_expert[b]:
    the (local) expert of rows b * block_m ..., or -1 for a tile past the last used row. No host sync.

    Only the pairs whose expert id lies in [expert_start, expert_start + num_experts) get rows (local expert id -
    expert_start); the rest (another expert-parallel rank's) are dropped. R's bound still assumes every pair local:
    the worst case, from shapes alone.

    one_launch (default: P <= ALIGN_KERNEL_MAX_PAIRS, on Triton): one single-program kernel (_moe_align_kernel)
    instead of moe_align_torch's ~30 small torch kernels: in a decode step's CUDA graph each launch costs ~2 us,
    several times the whole op's weight stream at batch 1. Both give the same layout."""
    P = topk_ids.numel()
    if one_launch is None:
        one_launch = HAS_TRITON and (topk_ids.is_cuda or interpreting()) and P <= ALIGN_KERNEL_MAX_PAIRS
    if not one_launch:
        return moe_align_torch(topk_ids, num_experts, block_m, expert_start)
    rows = max_sorted_rows(P, num_experts, block_m)
    dev = topk_ids.device
    sorted_ids = torch.empty(rows, dtype=torch.int32, device=dev)
    tile_expert = torch.empty(rows // block_m, dtype=torch.int32, device=dev)
    e_block = max(16, next_pow2(num_experts))
    cursor = torch.empty(e_block, dtype=torch.int32, device=dev)
    # Compare tiles of [CHUNK, E_BLOCK]: 4K elements, 32 a thread at 4 warps.
    chunk = max(16, min(64, 4096 // e_block))
    ids = topk_ids.reshape(-1)
    if ids.stride(0) != 1:
        ids = ids.contiguous()
    _moe_align_kernel[(1,)](ids, sorted_ids, tile_expert, cursor, P, num_experts, expert_start, rows, BLOCK_M=block_m,
                            E_BLOCK=e_block, CHUNK=chunk, FILL=min(1024, next_pow2(rows)), num_warps=4)
    return sorted_ids, tile_expert


def moe_align_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                    expert_start: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """moe_align's layout with torch ops (any P; the path of prefill-sized batches, where the sort's launches are
    lost in the GEMMs' time). No host sync: scatter_add_ rather than bincount, whose CUDA path reads the max back to
    size its output; the dropped pairs (outside the local experts) go to one extra bucket past the local experts,
    sort last and are scattered into a spare row past R instead of being selected out (which would sync)."""
    P = topk_ids.numel()
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64) - expert_start
    flat = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    # The dropped bucket holds no rows. (A narrowed zero_, not `counts[num_experts] = 0`: a Python scalar stored by
    # indexing is copied from the host, which CUDA graph capture refuses.)
    counts.narrow(0, num_experts, 1).zero_()
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    cnt_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    sorted_exp = flat[order]
    rows = max_sorted_rows(P, num_experts, block_m)
    dest = pad_start[sorted_exp] + torch.arange(P, device=dev) - cnt_start[sorted_exp]
    dest = torch.where(sorted_exp < num_experts, dest, rows)
    sorted_ids = torch.full((rows + 1,), P, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(0, rows, block_m, device=dev)
    # Experts whose padded group ends at or before a tile's first row: that tile's expert (empty experts end where
    # they start, so they are counted before the expert that owns the tile, never as its owner).
    tile_expert = torch.searchsorted(pad_end[:num_experts], starts, right=True)
    tile_expert = torch.where(tile_expert < num_experts, tile_expert, -1).to(torch.int32)
    return sorted_ids[:rows], tile_expert


if HAS_TRITON:

    @triton.jit
    def _moe_align_kernel(ids_ptr, sorted_ptr, tile_expert_ptr, cursor_ptr, P, E, START, R,
                          BLOCK_M: tl.constexpr, E_BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                          FILL: tl.constexpr):
        # Grid: (1,). One program does the whole sort (a decode batch has at most a few hundred pairs): per-expert
        # counts, padded group starts (cursor_ptr [E_BLOCK], scratch), the tile -> expert map, the padding fill,
        # then the pairs in CHUNKs in pair order, each placed at its expert's cursor + its rank among the chunk's
        # pairs of that expert. Barriers order the program's own global writes and reads between phases. Pairs
        # whose expert id - START falls outside [0, E) (another expert-parallel rank's) are counted nowhere and
        # placed nowhere.
        es = tl.arange(0, E_BLOCK)
        cs = tl.arange(0, CHUNK)
        counts = tl.zeros([E_BLOCK], dtype=tl.int32)
        for p0 in range(0, P, CHUNK):
            ps = p0 + cs
            e = tl.load(ids_ptr + ps, mask=ps < P, other=0).to(tl.int32) - START
            e = tl.where((ps < P) & (e >= 0) & (e < E), e, E_BLOCK)
            counts += tl.sum((e[:, None] == es[None, :]).to(tl.int32), axis=0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        pad_end = tl.cumsum(padded, 0)
        tl.store(cursor_ptr + es, pad_end - padded)
        for t0 in range(0, R // BLOCK_M, CHUNK):
            ts = t0 + cs
            # Experts whose group ends at or before the tile's first row: the tile's expert (an empty expert ends
            # where it starts, so it is counted before the expert that owns the tile). E or more: past the end.
            te = tl.sum((pad_end[None, :] <= (ts * BLOCK_M)[:, None]).to(tl.int32), axis=1)
            tl.store(tile_expert_ptr + ts, tl.where(te < E, te, -1), mask=ts < R // BLOCK_M)
        for r0 in range(0, R, FILL):
            rs = r0 + tl.arange(0, FILL)
            tl.store(sorted_ptr + rs, tl.zeros([FILL], dtype=tl.int32) + P, mask=rs < R)
        tl.debug_barrier()
        for p0 in range(0, P, CHUNK):
            ps = p0 + cs
            e = tl.load(ids_ptr + ps, mask=ps < P, other=0).to(tl.int32) - START
            valid = (ps < P) & (e >= 0) & (e < E)
            e = tl.where(valid, e, 0)
            same = (e[:, None] == e[None, :]) & (cs[None, :] < cs[:, None]) & valid[None, :]
            rank = tl.sum(same.to(tl.int32), axis=1)
            base = tl.load(cursor_ptr + e, mask=valid, other=0)
            tl.store(sorted_ptr + base + rank, ps, mask=valid)
            onehot = (e[:, None] == es[None, :]) & valid[:, None]
            advance = tl.sum(onehot.to(tl.int32), axis=0)
            tl.debug_barrier()  # every base read before any cursor moves
            tl.store(cursor_ptr + es, tl.load(cursor_ptr + es) + advance)
            tl.debug_barrier()  # the moved cursors visible to the next chunk's reads

    @triton.jit
    def _dot(acc, a, b, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr):
        """acc [M, N] += a [M, K] @ b [K, N], fp32 accumulation."""
        if UPCAST:  # the interpreter's dot mishandles 16-bit operands
            return acc + tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        return tl.dot(a, b, acc, input_precision=DOT_PREC)

    @triton.jit
    def _cast(v, DTYPE: tl.constexpr, RTNE: tl.constexpr):
        """fp32 v in DTYPE. RTNE (the interpreter, bf16): round to nearest even by hand first, since the
        interpreter's fp32 -> bf16 cast truncates where the GPU rounds, and the op rounds four times on the way."""
        if RTNE:
            b = v.to(tl.uint32, bitcast=True)
            b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
            v = b.to(tl.float32, bitcast=True)
        return v.to(DTYPE)

    @triton.jit
    def _quant_rows(a, amax_floor, fp8_max):
        """a [M, K] (one K step of the A tile) -> (its values / scale, clamped to +-448, fp32; scale [M] =
        amax / 448 per row): the e4m3 operand before its cast, and the row scales."""
        a = a.to(tl.float32)
        xs = tl.maximum(tl.max(tl.abs(a), axis=1), amax_floor) / fp8_max
        return tl.minimum(tl.maximum(a / xs[:, None], -fp8_max), fp8_max), xs

    @triton.jit
    def _dot_fp8(aq, w, UPCAST: tl.constexpr):
        """aq [M, K] (fp32, e4m3-ranged, not yet rounded) @ w [K, N] (float8_e4m3fn) -> fp32 [M, N]. UPCAST (the
        interpreter): both operands' e4m3 values in fp32 (products of e4m3 values are exact in fp32)."""
        if UPCAST:
            return tl.dot(fp8_triton._round_e4m3(aq), w.to(tl.float32), input_precision="ieee")
        return tl.dot(aq.to(tl.float8e4nv), w)

    @triton.jit
    def _moe_gate_up_kernel(
        x_ptr, w_ptr, act_ptr, sorted_ids_ptr, tile_expert_ptr, ws_ptr,
        P, I, H, TOPK, stride_x, stride_we, stride_wn, stride_act, stride_wse, stride_wsn, stride_wsk,
        amax_floor, fp8_max,
        UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, RTNE: tl.constexpr, FP8: tl.constexpr, W_BN: tl.constexpr,
        SCALE_COLS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        # Grid: (sorted tiles, cdiv(I, BLOCK_N)); axis 0 runs fastest, so the tiles of one expert that share a
        # weight tile run side by side (the weight tile is read from HBM once, then from L2).
        mb = tl.program_id(0)
        e = tl.load(tile_expert_ptr + mb)
        if e < 0:
            return
        pairs = tl.load(sorted_ids_ptr + mb * BLOCK_M + tl.arange(0, BLOCK_M))
        rmask = pairs < P
        tok = (pairs // TOPK).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < I
        ks = tl.arange(0, BLOCK_K)
        # int64: E * 2I * H passes 2^31 at MiniMax-M2's shapes.
        w_base = w_ptr + e.to(tl.int64) * stride_we
        if FP8:
            # The scale rows of the gate columns cols and of the up columns I + cols in w13_scale[e]. SCALE_COLS
            # False (BLOCK_N divides bn and I): each set lies in one row-block, one scalar a K step; True (a w13
            # quantized whole with I % BLOCK_N != 0): the up columns may straddle two, a [BLOCK_N] load each.
            ws_base = ws_ptr + e.to(tl.int64) * stride_wse
            n0 = tl.program_id(1) * BLOCK_N
            if SCALE_COLS:
                sg_ptrs = ws_base + (cols // W_BN) * stride_wsn
                su_ptrs = ws_base + ((cols + I) // W_BN) * stride_wsn
            else:
                sg_ptrs = ws_base + (n0 // W_BN) * stride_wsn
                su_ptrs = ws_base + ((n0 + I) // W_BN) * stride_wsn
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            kk = k0 + ks
            kmask = kk < H
            a = tl.load(x_ptr + tok[:, None] * stride_x + kk[None, :], mask=rmask[:, None] & kmask[None, :],
                        other=0.0)
            # [BLOCK_K, BLOCK_N] views of the gate rows cols and the up rows I + cols.
            wmask = kmask[:, None] & cmask[None, :]
            wg = tl.load(w_base + cols[None, :] * stride_wn + kk[:, None], mask=wmask, other=0.0)
            wu = tl.load(w_base + (cols[None, :] + I) * stride_wn + kk[:, None], mask=wmask, other=0.0)
            if FP8:
                # BLOCK_K = bk: this step is K block k0 // bk of the weight and one activation group of each row.
                aq, xs = _quant_rows(a, amax_floor, fp8_max)
                kb = k0 // BLOCK_K
                if SCALE_COLS:
                    sg = tl.load(sg_ptrs + kb * stride_wsk, mask=cmask, other=0.0)
                    su = tl.load(su_ptrs + kb * stride_wsk, mask=cmask, other=0.0)
                    acc_g += _dot_fp8(aq, wg, UPCAST) * xs[:, None] * sg[None, :]
                    acc_u += _dot_fp8(aq, wu, UPCAST) * xs[:, None] * su[None, :]
                else:
                    sg = tl.load(sg_ptrs + kb * stride_wsk)
                    su = tl.load(su_ptrs + kb * stride_wsk)
                    acc_g += _dot_fp8(aq, wg, UPCAST) * (xs * sg)[:, None]
                    acc_u += _dot_fp8(aq, wu, UPCAST) * (xs * su)[:, None]
            else:
                acc_g = _dot(acc_g, a, wg, UPCAST, DOT_PREC)
                acc_u = _dot(acc_u, a, wu, UPCAST, DOT_PREC)
        # The reference's GEMM output is in x's dtype before the fp32 activation: round the same way.
        g = _cast(acc_g, act_ptr.dtype.element_ty, RTNE).to(tl.float32)
        u = _cast(acc_u, act_ptr.dtype.element_ty, RTNE).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * u
        ptrs = act_ptr + pairs.to(tl.int64)[:, None] * stride_act + cols[None, :]
        tl.store(ptrs, _cast(y, act_ptr.dtype.element_ty, RTNE), mask=rmask[:, None] & cmask[None, :])

    @triton.jit
    def _moe_down_kernel(
        act_ptr, w_ptr, tw_ptr, y_ptr, sorted_ids_ptr, tile_expert_ptr, ws_ptr,
        P, H, I, stride_act, stride_we, stride_wn, stride_y, stride_wse, stride_wsn, stride_wsk,
        amax_floor, fp8_max,
        UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, RTNE: tl.constexpr, OUT_DTYPE: tl.constexpr,
        FP8: tl.constexpr, W_BN: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        # Grid: (sorted tiles, cdiv(H, BLOCK_N)), as the gate_up kernel's.
        mb = tl.program_id(0)
        e = tl.load(tile_expert_ptr + mb)
        if e < 0:
            return
        pairs = tl.load(sorted_ids_ptr + mb * BLOCK_M + tl.arange(0, BLOCK_M))
        rmask = pairs < P
        prow = pairs.to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < H
        ks = tl.arange(0, BLOCK_K)
        w_base = w_ptr + e.to(tl.int64) * stride_we
        if FP8:
            # BLOCK_N divides bn (fp8_config), so this program's columns lie in one scale row-block of w2_scale[e].
            s_ptr = ws_ptr + e.to(tl.int64) * stride_wse + (tl.program_id(1) * BLOCK_N // W_BN) * stride_wsn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            kk = k0 + ks
            kmask = kk < I
            a = tl.load(act_ptr + prow[:, None] * stride_act + kk[None, :], mask=rmask[:, None] & kmask[None, :],
                        other=0.0)
            w = tl.load(w_base + cols[None, :] * stride_wn + kk[:, None], mask=kmask[:, None] & cmask[None, :],
                        other=0.0)
            if FP8:
                aq, xs = _quant_rows(a, amax_floor, fp8_max)
                ws = tl.load(s_ptr + (k0 // BLOCK_K) * stride_wsk)
                acc += _dot_fp8(aq, w, UPCAST) * (xs * ws)[:, None]
            else:
                acc = _dot(acc, a, w, UPCAST, DOT_PREC)
        tw = tl.load(tw_ptr + pairs, mask=rmask, other=0.0)
        # The reference rounds the down GEMM's output to x's dtype, then weights it in fp32.
        y = _cast(acc, OUT_DTYPE, RTNE).to(tl.float32) * tw[:, None]
        ptrs = y_ptr + prow[:, None] * stride_y + cols[None, :]
        tl.store(ptrs, y, mask=rmask[:, None] & cmask[None, :])

    @triton.jit
    def _moe_sum_kernel(y_ptr, ids_ptr, out_ptr, H, E, START, stride_y, stride_out, TOPK: tl.constexpr,
                        RTNE: tl.constexpr, BLOCK: tl.constexpr):
        # Grid: (T, cdiv(H, BLOCK)). Adds a token's k rows j = 0..k-1 in that order: the same bits every run. A pair
        # whose expert is not among the local [START, START + E) got no row in the sort: its y row was never
        # written, so it is skipped (contributes 0).
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(TOPK):
            e = tl.load(ids_ptr + t * TOPK + j) - START + tl.zeros([BLOCK], dtype=tl.int64)
            keep = mask & (e >= 0) & (e < E)
            acc += tl.load(y_ptr + (t * TOPK + j) * stride_y + cols, mask=keep, other=0.0)
        tl.store(out_ptr + t * stride_out + cols, _cast(acc, out_ptr.dtype.element_ty, RTNE), mask=mask)


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, w13_scale: Optional[torch.Tensor] = None,
                     w2_scale: Optional[torch.Tensor] = None, block: Tuple[int, int] = (128, 128),
                     config: Optional[MoeConfig] = None, expert_start: int = 0,
                     total_experts: Optional[int] = None) -> torch.Tensor:
    """Same contract as fused_moe_ref: x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k] (fp32),
    topk_ids [T, k] int (each row's experts distinct; global ids, w13 / w2 holding experts [expert_start,
    expert_start + E), pairs outside contributing 0) -> [T, H] in x's dtype. FP8 experts: w13 / w2
    float8_e4m3fn, w13_scale fp32 [E, ceil(2I / bn), ceil(H / bk)], w2_scale fp32 [E, ceil(H / bn), ceil(I / bk)],
    block (bn, bk) with bk a power of two >= 16. No host sync. config overrides default_config / fp8_config
    (tests, sweeps); in FP8 mode its block_k must be bk. total_experts: the model's expert count under expert
    parallelism (None: E), which sizes the launch from this rank's expected share of the pairs (tuning_pairs)."""
    T, H = x.shape
    E, two_i, H2 = w13.shape
    inter = two_i // 2
    k = topk_ids.shape[1]
    assert H2 == H and tuple(w2.shape) == (E, H, inter), (tuple(x.shape), tuple(w13.shape), tuple(w2.shape))
    assert topk_weights.shape == topk_ids.shape and topk_ids.shape[0] == T
    fp8 = check_fp8_experts(w13, w2, w13_scale, w2_scale, block)
    bn, bk = (int(block[0]), int(block[1])) if fp8 else (1, 0)
    if fp8:
        if bk < 16 or bk & (bk - 1):
            raise ValueError(f"the FP8 weight block's width must be a power of two >= 16, got {bk}")
        if w13_scale.dtype != torch.float32 or w2_scale.dtype != torch.float32:
            raise ValueError("FP8 expert scales must be float32")
    else:
        assert w13.dtype == x.dtype and w2.dtype == x.dtype, "the grouped GEMMs run in x's dtype"
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    P = T * k
    if P == 0:
        return out.zero_()
    if x.stride(-1) != 1:
        x = x.contiguous()
    if w13.stride(-1) != 1:
        w13 = w13.contiguous()
    if w2.stride(-1) != 1:
        w2 = w2.contiguous()
    if fp8:
        cfg = config or fp8_config(tuning_pairs(P, E, total_experts), E, H, inter, (bn, bk), x.element_size())
        if cfg.up.block_k != bk or cfg.down.block_k != bk:
            raise ValueError(f"FP8 experts step K by the weight block's width {bk}; config has "
                             f"{cfg.up.block_k} / {cfg.down.block_k}")
        if bn % cfg.up.block_n or bn % cfg.down.block_n:
            raise ValueError(f"FP8 experts need BLOCK_N dividing the weight block's {bn} rows; config has "
                             f"{cfg.up.block_n} / {cfg.down.block_n}")
        s13, s2 = w13_scale, w2_scale
    else:
        cfg = config or default_config(tuning_pairs(P, E, total_experts), E, H, inter, x.element_size())
        s13, s2 = w13, w2  # unused by the unquantized kernels (FP8 False): any pointer, zero strides
    bm = cfg.block_m
    ids = topk_ids.reshape(-1)
    if ids.stride(0) != 1:
        ids = ids.contiguous()
    sorted_ids, tile_expert = moe_align(ids.view(T, k), E, bm, expert_start=expert_start)
    n_tiles = tile_expert.numel()
    tw = topk_weights.reshape(-1).to(torch.float32).contiguous()
    act = torch.empty(P, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(P, H, dtype=torch.float32, device=x.device)
    upcast = interpreting()
    rtne = upcast and x.dtype == torch.bfloat16
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    up, down = cfg.up, cfg.down
    out_dtype = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[x.dtype]
    s13_strides = tuple(s13.stride()) if fp8 else (0, 0, 0)
    s2_strides = tuple(s2.stride()) if fp8 else (0, 0, 0)
    _moe_gate_up_kernel[(n_tiles, triton.cdiv(inter, up.block_n))](
        x, w13, act, sorted_ids, tile_expert, s13,
        P, inter, H, k, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0), *s13_strides,
        AMAX_FLOOR, FP8_MAX,
        UPCAST=upcast, DOT_PREC=prec, RTNE=rtne, FP8=fp8, W_BN=bn, SCALE_COLS=fp8 and inter % up.block_n != 0,
        BLOCK_M=bm, BLOCK_N=up.block_n, BLOCK_K=up.block_k,
        num_warps=up.num_warps, num_stages=up.num_stages,
    )
    _moe_down_kernel[(n_tiles, triton.cdiv(H, down.block_n))](
        act, w2, tw, y, sorted_ids, tile_expert, s2,
        P, H, inter, act.stride(0), w2.stride(0), w2.stride(1), y.stride(0), *s2_strides,
        AMAX_FLOOR, FP8_MAX,
        UPCAST=upcast, DOT_PREC=prec, RTNE=rtne, OUT_DTYPE=out_dtype, FP8=fp8, W_BN=bn,
        BLOCK_M=bm, BLOCK_N=down.block_n, BLOCK_K=down.block_k,
        num_warps=down.num_warps, num_stages=down.num_stages,
    )
    block_sum = min(1024, max(16, next_pow2(H)))
    _moe_sum_kernel[(T, triton.cdiv(H, block_sum))](y, ids, out, H, E, expert_start, y.stride(0), out.stride(0),
                                                    TOPK=k, RTNE=rtne, BLOCK=block_sum, num_warps=4)
    return out
