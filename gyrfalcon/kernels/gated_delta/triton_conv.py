"""The Gated DeltaNet's depthwise causal conv1d + SiLU with per-request windows in state slots: over a ragged batch
of prefill chunks (causal_conv1d_ref) and for one token per sequence (causal_conv1d_update_ref).

Tap j of the K-wide conv reads the input K - 1 - j tokens back: a token of the chunk itself, or, before the
chunk's first token, a row of the window [K - 1, C] that the slot kept from the request's earlier tokens (zeros for
a request's first chunk). The window written back is the last K - 1 inputs of [window | chunk].
Shapes only, no host sync: the prefill's grid runs over token tiles of the whole batch (a tile may straddle
sequences; each token finds its sequence by a binary search of query_start_loc), so a long prompt spreads over as
many programs as a batch of short ones.
In-step snapshots (StateSaves): the window after a saved token row is written by the window kernel too, from the
step's inputs and the old window, in a launch between the conv and the slots' write-back (which overwrites the old
windows).
"""

from __future__ import annotations

import torch

from gyrfalcon.kernels.common import HAS_TRITON, tl, triton
from gyrfalcon.kernels.gated_delta import configs
from gyrfalcon.kernels.gated_delta.saves import StateSaves

if HAS_TRITON:

    # The batch's token and sequence counts are plain runtime ints: specialized (1, multiples of 16) they would
    # compile new variants as batch shapes change, in the middle of serving (tests/runner/test_jit_specialization.py).
    @triton.jit(do_not_specialize=["T", "B", "n_search"])
    def _conv_prefill_kernel(x_ptr, w_ptr, cs_ptr, slots_ptr, qsl_ptr, init_ptr, o_ptr, T, C, B, n_search,
                             sx_t, sw_c, sw_k, scs_n, scs_k, so_t,
                             K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
        # Grid: (cdiv(T, BT), cdiv(C, BC)). Tokens ts x channels cs of the batch -> silu(conv) at o_ptr.
        ts = tl.program_id(0) * BT + tl.arange(0, BT)
        cs = tl.program_id(1) * BC + tl.arange(0, BC)
        tm = ts < T
        cm = cs < C
        # The token's sequence: the last i in [0, B) with query_start_loc[i] <= t (an empty sequence ending where
        # t's begins has the same start and a lower index, so it never wins). Invariant: qsl[lo] <= t, answer <= hi.
        lo = tl.zeros([BT], dtype=tl.int32)
        hi = tl.zeros([BT], dtype=tl.int32) + (B - 1)
        for _ in range(n_search):
            mid = (lo + hi + 1) // 2
            ok = tl.load(qsl_ptr + mid) <= ts
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid - 1)
        p = ts - tl.load(qsl_ptr + lo)  # the token's position in its chunk
        slot = tl.load(slots_ptr + lo, mask=tm, other=0).to(tl.int64)
        init = tl.load(init_ptr + lo, mask=tm, other=0) != 0
        t64 = ts.to(tl.int64)
        acc = tl.zeros([BT, BC], dtype=tl.float32)
        for j in tl.static_range(K):
            src = p - (K - 1 - j)  # the tap's input position in the chunk; < 0: window row K - 1 + src
            in_x = tm & (src >= 0)
            xv = tl.load(x_ptr + (t64 - (K - 1 - j))[:, None] * sx_t + cs[None, :],
                         mask=in_x[:, None] & cm[None, :], other=0.0)
            wrow = K - 1 + src
            in_w = tm & (src < 0) & init
            wv = tl.load(cs_ptr + slot[:, None] * scs_n + wrow[:, None] * scs_k + cs[None, :],
                         mask=in_w[:, None] & cm[None, :], other=0.0)
            # The window in x's dtype, as the reference concatenates it (a no-op when the pool has x's dtype).
            val = xv.to(tl.float32) + wv.to(x_ptr.dtype.element_ty).to(tl.float32)
            acc += val * tl.load(w_ptr + cs * sw_c + j * sw_k, mask=cm, other=0.0).to(tl.float32)[None, :]
        y = acc / (1.0 + tl.exp(-acc))
        tl.store(o_ptr + t64[:, None] * so_t + cs[None, :], y.to(o_ptr.dtype.element_ty),
                 mask=tm[:, None] & cm[None, :])

    @triton.jit
    def _conv_window_kernel(x_ptr, cs_ptr, slots_ptr, qsl_ptr, init_ptr, seqs_ptr, rows_ptr, ids_ptr, dst_ptr, C,
                            sx_t, scs_n, scs_k, sdst_n, K: tl.constexpr, BC: tl.constexpr, SAVES: tl.constexpr):
        # Grid: (B, cdiv(C, BC)), or (NS, cdiv(C, BC)) for SAVES. A window after the first L tokens of a sequence's
        # chunk: row j is [window | chunk][L + j]. Without SAVES: sequence i's whole chunk, into its slot; runs after
        # the conv (the conv reads the old windows). Row L + j >= j + 1 of the old window is read before row j is
        # written and never after, each column by the same thread: in place is safe. With SAVES: save j's sequence,
        # up to and including its token row, into snapshot ids[j] (before the slots' write-back).
        j = tl.program_id(0)
        cs = tl.program_id(1) * BC + tl.arange(0, BC)
        if SAVES:
            i = tl.load(seqs_ptr + j)
            start = tl.load(qsl_ptr + i)
            L = tl.load(rows_ptr + j) + 1 - start
            dst = dst_ptr + tl.load(ids_ptr + j).to(tl.int64) * sdst_n + cs
        else:
            i = j
            start = tl.load(qsl_ptr + i)
            L = tl.load(qsl_ptr + i + 1) - start
        slot = tl.load(slots_ptr + i).to(tl.int64)
        init = tl.load(init_ptr + i) != 0
        # Scalar conditions become channel limits (a scalar bool in a mask trips the interpreter). An empty chunk
        # leaves its window alone, as the reference does.
        c_lim = tl.where(L > 0, C, 0)
        base = cs_ptr + slot * scs_n + cs
        if not SAVES:
            dst = base
        for r in tl.static_range(K - 1):
            m = L + r
            from_w = m < K - 1
            wv = tl.load(base + m * scs_k, mask=cs < tl.where(from_w & init, c_lim, 0), other=0.0)
            xv = tl.load(x_ptr + (start + m - (K - 1)).to(tl.int64) * sx_t + cs,
                         mask=cs < tl.where(from_w, 0, c_lim), other=0.0)
            val = tl.where(cs < tl.where(from_w, c_lim, 0), wv.to(x_ptr.dtype.element_ty), xv)
            tl.store(dst + r * scs_k, val.to(cs_ptr.dtype.element_ty), mask=cs < c_lim)

    @triton.jit
    def _conv_update_kernel(x_ptr, w_ptr, cs_ptr, slots_ptr, init_ptr, o_ptr, C, sx_b, sw_c, sw_k, scs_n, scs_k,
                            so_b, K: tl.constexpr, BC: tl.constexpr):
        # Grid: (B, cdiv(C, BC)). Window rows 0..K-2 then the token: the conv, and the window shifted by one in
        # place (row j takes row j + 1's value after row j + 1 was read, each column by the same thread).
        i = tl.program_id(0).to(tl.int64)
        cs = tl.program_id(1) * BC + tl.arange(0, BC)
        cm = cs < C
        slot = tl.load(slots_ptr + i).to(tl.int64)
        w_lim = tl.where(tl.load(init_ptr + i) != 0, C, 0)  # a one-token prompt starts from a zero window
        base = cs_ptr + slot * scs_n + cs
        cur = tl.load(base, mask=cs < w_lim, other=0.0).to(x_ptr.dtype.element_ty)
        acc = tl.zeros([BC], dtype=tl.float32)
        for j in tl.static_range(K - 1):
            acc += cur.to(tl.float32) * tl.load(w_ptr + cs * sw_c + j * sw_k, mask=cm, other=0.0).to(tl.float32)
            if j + 1 < K - 1:
                nxt = tl.load(base + (j + 1) * scs_k, mask=cs < w_lim, other=0.0).to(x_ptr.dtype.element_ty)
            else:
                nxt = tl.load(x_ptr + i * sx_b + cs, mask=cm, other=0.0)
            tl.store(base + j * scs_k, nxt.to(cs_ptr.dtype.element_ty), mask=cm)
            cur = nxt
        acc += cur.to(tl.float32) * tl.load(w_ptr + cs * sw_c + (K - 1) * sw_k, mask=cm, other=0.0).to(tl.float32)
        y = acc / (1.0 + tl.exp(-acc))
        tl.store(o_ptr + i * so_b + cs, y.to(o_ptr.dtype.element_ty), mask=cm)


def _check(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor) -> torch.Tensor:
    C, K = weight.shape
    assert K >= 2 and x.shape[-1] == C and conv_states.shape[1:] == (K - 1, C), (x.shape, weight.shape,
                                                                                  conv_states.shape)
    assert conv_states.stride(-1) == 1, conv_states.stride()
    return x if x.stride(-1) == 1 else x.contiguous()


def causal_conv1d_triton(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor,
                         state_slots: torch.Tensor, query_start_loc: torch.Tensor,
                         has_initial_state: torch.Tensor, conv_snapshots: torch.Tensor | None = None,
                         saves: StateSaves | None = None) -> torch.Tensor:
    """causal_conv1d_ref's contract in two launches (the conv, then the windows written back; a third between them
    with saves, into conv_snapshots [num_snapshots, K - 1, C]): x [T, C] (rows may be strided), weight [C, K],
    conv_states [num_slots, K - 1, C], state_slots / has_initial_state [B], query_start_loc [B + 1]
    -> silu(conv) [T, C] in x's dtype."""
    x = _check(x, weight, conv_states)
    T, C = x.shape
    K = weight.shape[1]
    B = state_slots.shape[0]
    out = torch.empty(T, C, dtype=x.dtype, device=x.device)
    if T == 0 or B == 0:
        return out
    bc = configs.CONV_BLOCK_C
    _conv_prefill_kernel[(triton.cdiv(T, configs.CONV_BLOCK_T), triton.cdiv(C, bc))](
        x, weight, conv_states, state_slots, query_start_loc, has_initial_state, out, T, C, B,
        max(B - 1, 0).bit_length(), x.stride(0), weight.stride(0), weight.stride(1), conv_states.stride(0),
        conv_states.stride(1), out.stride(0), K=K, BT=configs.CONV_BLOCK_T, BC=bc, num_warps=configs.CONV_NUM_WARPS)
    if saves is not None and saves.num_saves:
        assert conv_snapshots.dtype == conv_states.dtype and conv_snapshots.stride()[1:] == conv_states.stride()[1:]
        _conv_window_kernel[(saves.num_saves, triton.cdiv(C, bc))](
            x, conv_states, state_slots, query_start_loc, has_initial_state, saves.seqs, saves.rows, saves.ids,
            conv_snapshots, C, x.stride(0), conv_states.stride(0), conv_states.stride(1), conv_snapshots.stride(0),
            K=K, BC=bc, SAVES=True, num_warps=configs.CONV_NUM_WARPS)
    _conv_window_kernel[(B, triton.cdiv(C, bc))](
        x, conv_states, state_slots, query_start_loc, has_initial_state, state_slots, state_slots, state_slots,
        conv_states, C, x.stride(0), conv_states.stride(0), conv_states.stride(1), conv_states.stride(0), K=K,
        BC=bc, SAVES=False, num_warps=configs.CONV_NUM_WARPS)
    return out


def causal_conv1d_update_triton(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor,
                                state_slots: torch.Tensor, has_initial_state: torch.Tensor) -> torch.Tensor:
    """causal_conv1d_update_ref's contract in one launch: x [B, C] (rows may be strided), weight [C, K],
    conv_states [num_slots, K - 1, C] (shifted in place at state_slots [B]) -> silu(conv) [B, C] in x's dtype."""
    x = _check(x, weight, conv_states)
    B, C = x.shape
    K = weight.shape[1]
    out = torch.empty(B, C, dtype=x.dtype, device=x.device)
    if B == 0:
        return out
    bc = configs.CONV_UPDATE_BLOCK_C
    _conv_update_kernel[(B, triton.cdiv(C, bc))](
        x, weight, conv_states, state_slots, has_initial_state, out, C, x.stride(0), weight.stride(0),
        weight.stride(1), conv_states.stride(0), conv_states.stride(1), out.stride(0), K=K, BC=bc,
        num_warps=configs.CONV_NUM_WARPS)
    return out
