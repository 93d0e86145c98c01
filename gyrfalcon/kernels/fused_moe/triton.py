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
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from gyrfalcon.kernels.common import HAS_TRITON, cdiv, interpreting, next_pow2, tl, triton
from gyrfalcon.kernels.fused_moe.configs import ALIGN_KERNEL_MAX_PAIRS, MoeConfig, default_config


def max_sorted_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the sorted, padded order, an upper bound from shapes only: each expert that has pairs pads at most
    block_m - 1 rows, and at most min(E, P) experts have pairs. A multiple of block_m."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return cdiv(bound, block_m) * block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int,
              one_launch: Optional[bool] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] int -> (sorted_ids [R] int32, tile_expert [R / block_m] int32), R = max_sorted_rows.

    sorted_ids: pair ids (t * k + j) grouped by expert in ascending expert order, pairs of one expert in ascending
    pair order, each expert's group starting at a multiple of block_m; padding rows hold P = T * k. tile_expert[b]:
    the expert of rows b * block_m ..., or -1 for a tile past the last used row. No host sync.

    one_launch (default: P <= ALIGN_KERNEL_MAX_PAIRS, on Triton): one single-program kernel (_moe_align_kernel)
    instead of moe_align_torch's ~30 small torch kernels: in a decode step's CUDA graph each launch costs ~2 us,
    several times the whole op's weight stream at batch 1. Both give the same layout."""
    P = topk_ids.numel()
    if one_launch is None:
        one_launch = HAS_TRITON and (topk_ids.is_cuda or interpreting()) and P <= ALIGN_KERNEL_MAX_PAIRS
    if not one_launch:
        return moe_align_torch(topk_ids, num_experts, block_m)
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
    _moe_align_kernel[(1,)](ids, sorted_ids, tile_expert, cursor, P, num_experts, rows, BLOCK_M=block_m,
                            E_BLOCK=e_block, CHUNK=chunk, FILL=min(1024, next_pow2(rows)), num_warps=4)
    return sorted_ids, tile_expert


def moe_align_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """moe_align's layout with torch ops (any P; the path of prefill-sized batches, where the sort's launches are
    lost in the GEMMs' time). No host sync: scatter_add_ rather than bincount, whose CUDA path reads the max back to
    size its output."""
    P = topk_ids.numel()
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    cnt_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    sorted_exp = flat[order]
    dest = pad_start[sorted_exp] + torch.arange(P, device=dev) - cnt_start[sorted_exp]
    rows = max_sorted_rows(P, num_experts, block_m)
    sorted_ids = torch.full((rows,), P, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(0, rows, block_m, device=dev)
    # Experts whose padded group ends at or before a tile's first row: that tile's expert (empty experts end where
    # they start, so they are counted before the expert that owns the tile, never as its owner).
    tile_expert = torch.searchsorted(pad_end, starts, right=True)
    tile_expert = torch.where(tile_expert < num_experts, tile_expert, -1).to(torch.int32)
    return sorted_ids, tile_expert


if HAS_TRITON:

    @triton.jit
    def _moe_align_kernel(ids_ptr, sorted_ptr, tile_expert_ptr, cursor_ptr, P, E, R,
                          BLOCK_M: tl.constexpr, E_BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                          FILL: tl.constexpr):
        # Grid: (1,). One program does the whole sort (a decode batch has at most a few hundred pairs): per-expert
        # counts, padded group starts (cursor_ptr [E_BLOCK], scratch), the tile -> expert map, the padding fill,
        # then the pairs in CHUNKs in pair order, each placed at its expert's cursor + its rank among the chunk's
        # pairs of that expert. Barriers order the program's own global writes and reads between phases.
        es = tl.arange(0, E_BLOCK)
        cs = tl.arange(0, CHUNK)
        counts = tl.zeros([E_BLOCK], dtype=tl.int32)
        for p0 in range(0, P, CHUNK):
            ps = p0 + cs
            e = tl.load(ids_ptr + ps, mask=ps < P, other=E_BLOCK).to(tl.int32)
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
            valid = ps < P
            e = tl.load(ids_ptr + ps, mask=valid, other=0).to(tl.int32)
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
    def _moe_gate_up_kernel(
        x_ptr, w_ptr, act_ptr, sorted_ids_ptr, tile_expert_ptr,
        P, I, H, TOPK, stride_x, stride_we, stride_wn, stride_act,
        UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, RTNE: tl.constexpr,
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
        act_ptr, w_ptr, tw_ptr, y_ptr, sorted_ids_ptr, tile_expert_ptr,
        P, H, I, stride_act, stride_we, stride_wn, stride_y,
        UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, RTNE: tl.constexpr, OUT_DTYPE: tl.constexpr,
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
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            kk = k0 + ks
            kmask = kk < I
            a = tl.load(act_ptr + prow[:, None] * stride_act + kk[None, :], mask=rmask[:, None] & kmask[None, :],
                        other=0.0)
            w = tl.load(w_base + cols[None, :] * stride_wn + kk[:, None], mask=kmask[:, None] & cmask[None, :],
                        other=0.0)
            acc = _dot(acc, a, w, UPCAST, DOT_PREC)
        tw = tl.load(tw_ptr + pairs, mask=rmask, other=0.0)
        # The reference rounds the down GEMM's output to x's dtype, then weights it in fp32.
        y = _cast(acc, OUT_DTYPE, RTNE).to(tl.float32) * tw[:, None]
        ptrs = y_ptr + prow[:, None] * stride_y + cols[None, :]
        tl.store(ptrs, y, mask=rmask[:, None] & cmask[None, :])

    @triton.jit
    def _moe_sum_kernel(y_ptr, out_ptr, H, stride_y, stride_out, TOPK: tl.constexpr, RTNE: tl.constexpr,
                        BLOCK: tl.constexpr):
        # Grid: (T, cdiv(H, BLOCK)). Adds a token's k rows j = 0..k-1 in that order: the same bits every run.
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(TOPK):
            acc += tl.load(y_ptr + (t * TOPK + j) * stride_y + cols, mask=mask, other=0.0)
        tl.store(out_ptr + t * stride_out + cols, _cast(acc, out_ptr.dtype.element_ty, RTNE), mask=mask)


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, config: Optional[MoeConfig] = None) -> torch.Tensor:
    """Same contract as fused_moe_ref: x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k] (fp32),
    topk_ids [T, k] int (each row's experts distinct) -> [T, H] in x's dtype. No host sync. config overrides
    default_config (tests, sweeps)."""
    T, H = x.shape
    E, two_i, H2 = w13.shape
    inter = two_i // 2
    k = topk_ids.shape[1]
    assert H2 == H and tuple(w2.shape) == (E, H, inter), (tuple(x.shape), tuple(w13.shape), tuple(w2.shape))
    assert topk_weights.shape == topk_ids.shape and topk_ids.shape[0] == T
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
    cfg = config or default_config(P, E, H, inter, x.element_size())
    bm = cfg.block_m
    sorted_ids, tile_expert = moe_align(topk_ids, E, bm)
    n_tiles = tile_expert.numel()
    tw = topk_weights.reshape(-1).to(torch.float32).contiguous()
    act = torch.empty(P, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(P, H, dtype=torch.float32, device=x.device)
    upcast = interpreting()
    rtne = upcast and x.dtype == torch.bfloat16
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    up, down = cfg.up, cfg.down
    out_dtype = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[x.dtype]
    _moe_gate_up_kernel[(n_tiles, triton.cdiv(inter, up.block_n))](
        x, w13, act, sorted_ids, tile_expert,
        P, inter, H, k, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        UPCAST=upcast, DOT_PREC=prec, RTNE=rtne, BLOCK_M=bm, BLOCK_N=up.block_n, BLOCK_K=up.block_k,
        num_warps=up.num_warps, num_stages=up.num_stages,
    )
    _moe_down_kernel[(n_tiles, triton.cdiv(H, down.block_n))](
        act, w2, tw, y, sorted_ids, tile_expert,
        P, H, inter, act.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        UPCAST=upcast, DOT_PREC=prec, RTNE=rtne, OUT_DTYPE=out_dtype,
        BLOCK_M=bm, BLOCK_N=down.block_n, BLOCK_K=down.block_k,
        num_warps=down.num_warps, num_stages=down.num_stages,
    )
    block = min(1024, max(16, next_pow2(H)))
    _moe_sum_kernel[(T, triton.cdiv(H, block))](y, out, H, y.stride(0), out.stride(0), TOPK=k, RTNE=rtne, BLOCK=block,
                                                num_warps=4)
    return out
