"""The recurrent states after each token but the last of a verify step's rows (position_states.py's
verify_position_states_ref contract) in one launch, for a captured verify graph of a hybrid model.

Rows of L = 1 + k tokens; per token and value head hv the decode step's rule (triton_decode.py)
    S <- exp(g) S;  delta = beta (v - S^T k);  S <- S + k delta^T
from the row's slot (zeros where it starts at position 0), with no output and the state stored after each of the
first L - 1 tokens instead of written back: the slot is left alone (the step's prefill writes its final state).
The grid splits dv into tiles as the decode kernel does, (B, HV, dv / BV) programs, each loading its [dk, BV]
state tile once and storing L - 1 tiles: the state memory moved is L times the state, where the plain-torch
reference moves it several times a token. Shapes only: no host sync.
"""

from __future__ import annotations

import torch

from gyrfalcon.kernels.common import HAS_TRITON, next_pow2, tl, triton
from gyrfalcon.kernels.gated_delta import configs
from gyrfalcon.kernels.gated_delta.naive import L2_EPS

if HAS_TRITON:
    from gyrfalcon.kernels.gated_delta.triton_decode import gating_f32

    L2_EPS_C = tl.constexpr(L2_EPS)

    @triton.jit
    def _position_states_kernel(k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, states_ptr, slots_ptr, init_ptr,
                                out_ptr, sk_b, sk_l, sk_h, sv_b, sv_l, sv_h, sa_b, sa_l, sb_b, sb_l, ss_n, ss_h, ss_k,
                                so_b, so_l, so_h, so_k, NT: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                                R: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
        # Grid: (B, HV, cdiv(DV, BV)). Row i, value head hv (key head hv // R), value columns of tile vt; NT = L - 1.
        i = tl.program_id(0).to(tl.int64)
        hv = tl.program_id(1)
        vt = tl.program_id(2)
        kh = hv // R
        slot = tl.load(slots_ptr + i).to(tl.int64)
        # (the limit as a row count: a scalar bool in a mask trips the interpreter; triton_decode.py)
        init_rows = tl.where(tl.load(init_ptr + i) != 0, DK, 0)
        ks = tl.arange(0, BK)
        km = ks < DK
        vs = vt * BV + tl.arange(0, BV)
        vm = vs < DV
        S = tl.load(states_ptr + slot * ss_n + hv * ss_h + ks[:, None] * ss_k + vs[None, :],
                    mask=(ks[:, None] < init_rows) & vm[None, :], other=0.0)  # [BK, BV] fp32
        A_log = tl.load(A_log_ptr + hv).to(tl.float32)
        dt_bias = tl.load(dt_bias_ptr + hv).to(tl.float32)
        omask = km[:, None] & vm[None, :]
        for t in tl.static_range(NT):
            k = tl.load(k_ptr + i * sk_b + t * sk_l + kh * sk_h + ks, mask=km, other=0.0).to(tl.float32)
            k = k * tl.rsqrt(tl.sum(k * k, axis=0) + L2_EPS_C)
            a = tl.load(a_ptr + i * sa_b + t * sa_l + hv).to(tl.float32)
            b = tl.load(b_ptr + i * sb_b + t * sb_l + hv).to(tl.float32)
            g, beta = gating_f32(a, b, A_log, dt_bias)
            S = S * tl.exp(g)
            v = tl.load(v_ptr + i * sv_b + t * sv_l + hv * sv_h + vs, mask=vm, other=0.0).to(tl.float32)
            delta = (v - tl.sum(S * k[:, None], axis=0)) * beta  # [BV]
            S = S + k[:, None] * delta[None, :]
            tl.store(out_ptr + i * so_b + t * so_l + hv * so_h + ks[:, None] * so_k + vs[None, :], S, mask=omask)


def verify_position_states_triton(k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                                  A_log: torch.Tensor, dt_bias: torch.Tensor, states: torch.Tensor,
                                  state_slots: torch.Tensor, has_initial_state: torch.Tensor, out: torch.Tensor,
                                  block_v: int | None = None) -> torch.Tensor:
    """verify_position_states_ref's contract in one launch: k [B, L, H, dk]; v [B, L, HV, dv]; a, b [B, L, HV]
    (rows may be strided: slices of a projection); states [num_slots, HV, dk, dv] fp32 (read at state_slots [B]
    where has_initial_state [B], else zeros) -> out [B, >= L - 1, HV, dk, dv] fp32, written and returned."""
    B, L, H, dk = k.shape
    HV, dv = v.shape[2], v.shape[3]
    assert HV % H == 0 and states.dtype == torch.float32 and out.dtype == torch.float32, (k.shape, v.shape)
    assert states.shape[1:] == (HV, dk, dv) and states.stride(-1) == 1 and out.stride(-1) == 1, states.shape
    assert out.shape[0] == B and out.shape[1] >= L - 1 and out.shape[2:] == (HV, dk, dv), out.shape
    assert k.stride(-1) == v.stride(-1) == a.stride(-1) == b.stride(-1) == 1
    if B == 0 or L < 2:
        return out
    bv = block_v or configs.decode_block_v(B, HV, dv)
    _position_states_kernel[(B, HV, triton.cdiv(dv, bv))](
        k, v, a, b, A_log, dt_bias, states, state_slots, has_initial_state, out,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), a.stride(0), a.stride(1),
        b.stride(0), b.stride(1), states.stride(0), states.stride(1), states.stride(2),
        out.stride(0), out.stride(1), out.stride(2), out.stride(3),
        NT=L - 1, DK=dk, DV=dv, R=HV // H, BK=next_pow2(dk), BV=bv, num_warps=configs.DECODE_NUM_WARPS)
    return out
