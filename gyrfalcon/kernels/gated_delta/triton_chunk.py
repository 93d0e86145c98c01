"""The chunked gated delta rule over a ragged batch of prefill chunks in one launch (gated_delta_prefill_ref's
contract: gating, q/k L2 norm, the rule from each slot's state, final states written back).

The simple form: one program per (sequence, value head, value tile) walks its sequence CHUNK tokens at a time with
the state tile S [dk, BV] in registers, doing per chunk what chunk_gated_delta_rule_ref's docstring writes out
(G = cumsum(g), D[i, j] = exp(G_i - G_j) for j <= i, A[i, j] = beta_i (k_i . k_j) D[i, j] for j < i):
    T = (I + A)^-1;  v' = T (beta v) - T (beta exp(G) k) S = T (beta (v - exp(G) (k S)))
    o = (exp(G) q) S + ((q k^T) * D) v';  S <- exp(G_C) S + (exp(G_C - G) k)^T v'
T comes from block doubling (_unit_lower_inverse): log2(CHUNK) levels of tile products, stable where the Neumann
series of A would cancel catastrophically (near-equal keys with beta near 1 give |A| entries near 1). Value columns
are independent given T, so the dv tiles split the work; each tile recomputes the chunk's A and T (work that does
not depend on the tile). The dots run in configs.CHUNK_DOT_PRECISION (the interpreter computes them in fp32).
Shapes only, no host sync: each program reads its sequence's bounds from query_start_loc.

In-step snapshots (StateSaves, hybrid prefix caching): v'_i depends on tokens <= i only, so the state after token p
of a chunk is the chunk-end update cut at p, exp(G_p) S + (exp(G_p - G) k)_{<=p}^T v'_{<=p}: one more [dk, CH] x
[CH, BV] product per save, written to the snapshot pool while the program walks its sequence's saves beside its
chunks. The chunks stay at 64-token offsets from the sequence's start, so a step's outputs are the same whatever
it saves (HAS_SAVES compiles the walk out of steps without saves).
"""

from __future__ import annotations

import torch

from gyrfalcon.kernels.common import HAS_TRITON, next_pow2, tl, triton
from gyrfalcon.kernels.gated_delta import configs
from gyrfalcon.kernels.gated_delta.naive import CHUNK_SIZE, L2_EPS
from gyrfalcon.kernels.gated_delta.saves import StateSaves

if HAS_TRITON:
    from gyrfalcon.kernels.gated_delta.triton_decode import gating_f32

    L2_EPS_C = tl.constexpr(L2_EPS)

    @triton.jit
    def _unit_lower_inverse(A, CH: tl.constexpr, LOG2_CH: tl.constexpr, PREC: tl.constexpr):
        """(I + A)^-1 for A strictly lower triangular [CH, CH] (CH a power of two), by block doubling: with T the
        inverse of each diagonal block of size s, the inverse over blocks of 2s is T - T M T, M holding only A's
        lower-left s x s quadrant of each 2s block (the inverse of [[L1, 0], [A21, L2]] is
        [[L1^-1, 0], [-L2^-1 A21 L1^-1, L2^-1]]). log2(CH) levels of two tile products, no row-by-row loop; like
        forward substitution it never forms powers of A (whose entries grow combinatorially and cancel)."""
        rows = tl.arange(0, CH)[:, None]
        cols = tl.arange(0, CH)[None, :]
        inv = tl.where(rows == cols, 1.0, 0.0)
        s = 1
        for _ in tl.static_range(LOG2_CH):
            quad = ((rows // (2 * s)) == (cols // (2 * s))) & ((rows // s) % 2 == 1) & ((cols // s) % 2 == 0)
            M = tl.where(quad, A, 0.0)
            inv = inv - tl.dot(inv, tl.dot(M, inv, input_precision=PREC), input_precision=PREC)
            s = s * 2
        return inv

    @triton.jit
    def _chunk_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, states_ptr, slots_ptr, qsl_ptr,
                      init_ptr, o_ptr, snap_ptr, sloc_ptr, srow_ptr, sid_ptr, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h,
                      sa_t, sb_t, ss_n, ss_h, ss_k, so_t, so_h, ssnap_n, scale, DK: tl.constexpr, DV: tl.constexpr,
                      R: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, CH: tl.constexpr,
                      LOG2_CH: tl.constexpr, PREC: tl.constexpr, HAS_SAVES: tl.constexpr):
        # Grid: (B, HV, cdiv(DV, BV)). Sequence i, value head hv (key head hv // R), value columns of tile vt.
        i = tl.program_id(0)
        hv = tl.program_id(1)
        vt = tl.program_id(2)
        kh = hv // R
        start = tl.load(qsl_ptr + i)
        end = tl.load(qsl_ptr + i + 1)
        slot = tl.load(slots_ptr + i).to(tl.int64)
        # Row limits instead of scalar bools in masks (they trip the interpreter): zeros where the sequence starts
        # at position 0; no write-back for an empty chunk (the reference leaves its slot alone).
        init_rows = tl.where(tl.load(init_ptr + i) != 0, DK, 0)
        out_rows = tl.where(end > start, DK, 0)
        ks = tl.arange(0, BK)
        km = ks < DK
        vs = vt * BV + tl.arange(0, BV)
        vm = vs < DV
        cr = tl.arange(0, CH)
        lower = cr[:, None] >= cr[None, :]
        A_log = tl.load(A_log_ptr + hv).to(tl.float32)
        dt_bias = tl.load(dt_bias_ptr + hv).to(tl.float32)

        s_ptrs = states_ptr + slot * ss_n + hv * ss_h + ks[:, None] * ss_k + vs[None, :]
        S = tl.load(s_ptrs, mask=(ks[:, None] < init_rows) & vm[None, :], other=0.0)  # [BK, BV]
        if HAS_SAVES:
            # This sequence's saves sv..s_hi - 1 (token rows ascending); nxt: the next one's row, `end` past them.
            sv = tl.load(sloc_ptr + i)
            s_hi = tl.load(sloc_ptr + i + 1)
            nxt = tl.where(sv < s_hi, tl.load(srow_ptr + tl.maximum(tl.minimum(sv, s_hi - 1), 0)), end)
        for c0 in range(start, end, CH):
            ts = c0 + cr
            tm = ts < end
            t64 = ts.to(tl.int64)
            qk_mask = tm[:, None] & km[None, :]
            a = tl.load(a_ptr + t64 * sa_t + hv, mask=tm, other=0.0).to(tl.float32)
            b = tl.load(b_ptr + t64 * sb_t + hv, mask=tm, other=0.0).to(tl.float32)
            g, beta = gating_f32(a, b, A_log, dt_bias)
            # Past the sequence's end: no decay and no update (G stays at the last token's, k and v are 0).
            g = tl.where(tm, g, 0.0)
            beta = tl.where(tm, beta, 0.0)
            G = tl.cumsum(g, axis=0)  # [CH]
            eG = tl.exp(G)
            D = tl.where(lower, tl.exp(tl.where(lower, G[:, None] - G[None, :], 0.0)), 0.0)  # [CH, CH]
            k = tl.load(k_ptr + t64[:, None] * sk_t + kh * sk_h + ks[None, :], mask=qk_mask, other=0.0)
            k = k.to(tl.float32)
            k = k * tl.rsqrt(tl.sum(k * k, axis=1) + L2_EPS_C)[:, None]
            KK = tl.dot(k, tl.trans(k), input_precision=PREC)
            A = tl.where(cr[:, None] > cr[None, :], KK * D * beta[:, None], 0.0)  # strictly lower
            Tinv = _unit_lower_inverse(A, CH, LOG2_CH, PREC)
            q = tl.load(q_ptr + t64[:, None] * sq_t + kh * sq_h + ks[None, :], mask=qk_mask, other=0.0)
            q = q.to(tl.float32)
            q = q * (tl.rsqrt(tl.sum(q * q, axis=1) + L2_EPS_C) * scale)[:, None]  # [CH, BK]
            v = tl.load(v_ptr + t64[:, None] * sv_t + hv * sv_h + vs[None, :], mask=tm[:, None] & vm[None, :],
                        other=0.0).to(tl.float32)  # [CH, BV]
            QK = tl.dot(q, tl.trans(k), input_precision=PREC) * D
            o = tl.dot(q * eG[:, None], S, input_precision=PREC)  # [CH, BV]: the state's part
            # v' = U - W S computed as T (beta (v - exp(G) (k S))): one [CH, CH] x [CH, BV] product after k S, no
            # [CH, dk] W tile.
            kS = tl.dot(k, S, input_precision=PREC)  # [CH, BV]
            v_new = tl.dot(Tinv, beta[:, None] * (v - eG[:, None] * kS), input_precision=PREC)
            o += tl.dot(QK, v_new, input_precision=PREC)
            tl.store(o_ptr + t64[:, None] * so_t + hv * so_h + vs[None, :], o.to(o_ptr.dtype.element_ty),
                     mask=tm[:, None] & vm[None, :])
            if HAS_SAVES:
                c_hi = tl.minimum(c0 + CH, end)
                while nxt < c_hi:
                    p = nxt - c0  # the saved token's index in the chunk
                    keep = cr <= p
                    G_p = tl.sum(tl.where(cr == p, G, 0.0), axis=0)
                    k_p = tl.where(keep[:, None], k * tl.exp(tl.where(keep, G_p - G, 0.0))[:, None], 0.0)
                    S_p = S * tl.exp(G_p) + tl.dot(tl.trans(k_p), v_new, input_precision=PREC)
                    sid = tl.load(sid_ptr + sv).to(tl.int64)
                    tl.store(snap_ptr + sid * ssnap_n + hv * ss_h + ks[:, None] * ss_k + vs[None, :], S_p,
                             mask=km[:, None] & vm[None, :])
                    sv += 1
                    nxt = tl.where(sv < s_hi, tl.load(srow_ptr + tl.minimum(sv, s_hi - 1)), end)
            G_end = tl.sum(tl.where(cr == CH - 1, G, 0.0), axis=0)
            k_end = k * tl.exp(G_end - G)[:, None]
            S = S * tl.exp(G_end) + tl.dot(tl.trans(k_end), v_new, input_precision=PREC)
        tl.store(s_ptrs, S, mask=(ks[:, None] < out_rows) & vm[None, :])


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def gated_delta_prefill_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                               A_log: torch.Tensor, dt_bias: torch.Tensor, states: torch.Tensor,
                               state_slots: torch.Tensor, query_start_loc: torch.Tensor,
                               has_initial_state: torch.Tensor, state_snapshots: torch.Tensor | None = None,
                               saves: StateSaves | None = None, block_v: int | None = None) -> torch.Tensor:
    """gated_delta_prefill_ref's contract in one launch: q, k [T, H, dk]; v [T, HV, dv]; a, b [T, HV]; A_log,
    dt_bias [HV]; states [num_slots, HV, dk, dv] fp32 (read at state_slots [B] where has_initial_state [B], else
    zeros; final states written back); query_start_loc [B + 1]; with saves, state_snapshots
    [num_snapshots, HV, dk, dv] fp32 rows written -> o [T, HV, dv] in v's dtype."""
    T, H, dk = q.shape
    HV, dv = v.shape[1], v.shape[2]
    assert HV % H == 0 and k.shape == q.shape and states.dtype == torch.float32, (q.shape, v.shape, states.dtype)
    assert states.shape[1:] == (HV, dk, dv) and states.stride(-1) == 1, states.shape
    q, k, v, a, b = (_last_dim_contiguous(t) for t in (q, k, v, a, b))
    B = state_slots.shape[0]
    o = torch.empty(T, HV, dv, dtype=v.dtype, device=v.device)
    if T == 0 or B == 0:
        return o
    has_saves = saves is not None and saves.num_saves > 0
    if has_saves:
        # The snapshot rows index like the slots past dim 0 (runner/kv_cache.py allocates both from one spec).
        assert state_snapshots.dtype == torch.float32 and state_snapshots.stride()[1:] == states.stride()[1:], (
            state_snapshots.dtype, state_snapshots.stride(), states.stride())
        snap, sloc, srow, sid = state_snapshots, saves.seq_loc, saves.rows, saves.ids
    else:  # (unused pointers)
        snap, sloc, srow, sid = states, query_start_loc, query_start_loc, query_start_loc
    # tl.dot wants every dimension >= 16.
    bv = block_v or max(16, min(configs.CHUNK_BLOCK_V, next_pow2(dv)))
    _chunk_kernel[(B, HV, triton.cdiv(dv, bv))](
        q, k, v, a, b, A_log, dt_bias, states, state_slots, query_start_loc, has_initial_state, o, snap, sloc, srow,
        sid, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
        states.stride(0), states.stride(1), states.stride(2), o.stride(0), o.stride(1), snap.stride(0), dk ** -0.5,
        DK=dk, DV=dv, R=HV // H, BK=max(16, next_pow2(dk)), BV=bv, CH=CHUNK_SIZE, LOG2_CH=CHUNK_SIZE.bit_length() - 1,
        PREC=configs.CHUNK_DOT_PRECISION, HAS_SAVES=has_saves, num_warps=configs.CHUNK_NUM_WARPS)
    return o
