"""The Gated DeltaNet decode step in one launch: gating, q/k L2 norm, the delta update of the state in place and
the output, for B sequences of one token each (gated_delta_decode_ref's contract).

Per token and value head hv, with S the [dk, dv] fp32 state in the sequence's slot:
    S <- exp(g) S;  delta = beta (v - S^T k);  S <- S + k delta^T;  o = S^T q
Every value column of S evolves on its own (delta's column j needs only S's column j), so the grid splits dv into
tiles: (B, HV, dv / BV) programs, each loading its [dk, BV] state tile once, updating it in registers and storing
it back. The token's q and k (one key head for r = HV / H value heads) are loaded and normalized by every program
that needs them: dk values, far less than the state tile. Shapes only: no host sync, so a CUDA graph can capture it.
"""

from __future__ import annotations

import torch

from gyrfalcon.kernels.common import HAS_TRITON, next_pow2, tl, triton
from gyrfalcon.kernels.gated_delta import configs
from gyrfalcon.kernels.gated_delta.naive import L2_EPS

if HAS_TRITON:
    L2_EPS_C = tl.constexpr(L2_EPS)

    @triton.jit
    def softplus_f32(x):
        """torch's softplus (beta 1, threshold 20) in fp32: log1p(exp(x)), written as max(x, 0) + log1p(exp(-|x|))
        with log1p's Taylor start where 1 + u would round to 1 (x far below 0, where softplus is exp(x))."""
        u = tl.exp(-tl.abs(x))
        l1p = tl.where(u < 1e-4, u * (1.0 - 0.5 * u), tl.log(1.0 + u))
        return tl.where(x > 20.0, x, tl.maximum(x, 0.0) + l1p)

    @triton.jit
    def gating_f32(a, b, A_log, dt_bias):
        """(g, beta) of gdn_gating_ref from fp32 scalars or tensors."""
        g = -tl.exp(A_log) * softplus_f32(a + dt_bias)
        beta = 1.0 / (1.0 + tl.exp(-b))
        return g, beta

    @triton.jit
    def _decode_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, states_ptr, slots_ptr, init_ptr,
                       o_ptr, sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, sa_b, sb_b, ss_n, ss_h, ss_k, so_b, so_h, scale,
                       DK: tl.constexpr, DV: tl.constexpr, R: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
        # Grid: (B, HV, cdiv(DV, BV)). Sequence i, value head hv (key head hv // R), value columns of tile vt.
        i = tl.program_id(0).to(tl.int64)
        hv = tl.program_id(1)
        vt = tl.program_id(2)
        kh = hv // R
        slot = tl.load(slots_ptr + i).to(tl.int64)
        # A sequence at position 0 starts from zeros whatever its slot holds (a finished request's state, or NaN):
        # its state rows are all masked off (the limit as a row count: a scalar bool in a mask trips the interpreter).
        init_rows = tl.where(tl.load(init_ptr + i) != 0, DK, 0)
        ks = tl.arange(0, BK)
        km = ks < DK
        vs = vt * BV + tl.arange(0, BV)
        vm = vs < DV

        q = tl.load(q_ptr + i * sq_b + kh * sq_h + ks, mask=km, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + i * sk_b + kh * sk_h + ks, mask=km, other=0.0).to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + L2_EPS_C) * scale
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + L2_EPS_C)
        a = tl.load(a_ptr + i * sa_b + hv).to(tl.float32)
        b = tl.load(b_ptr + i * sb_b + hv).to(tl.float32)
        g, beta = gating_f32(a, b, tl.load(A_log_ptr + hv).to(tl.float32), tl.load(dt_bias_ptr + hv).to(tl.float32))

        s_ptrs = states_ptr + slot * ss_n + hv * ss_h + ks[:, None] * ss_k + vs[None, :]
        smask = km[:, None] & vm[None, :]
        S = tl.load(s_ptrs, mask=(ks[:, None] < init_rows) & vm[None, :], other=0.0) * tl.exp(g)  # [BK, BV]
        v = tl.load(v_ptr + i * sv_b + hv * sv_h + vs, mask=vm, other=0.0).to(tl.float32)
        delta = (v - tl.sum(S * k[:, None], axis=0)) * beta  # [BV]
        S = S + k[:, None] * delta[None, :]
        tl.store(s_ptrs, S, mask=smask)
        o = tl.sum(S * q[:, None], axis=0)
        tl.store(o_ptr + i * so_b + hv * so_h + vs, o.to(o_ptr.dtype.element_ty), mask=vm)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def gated_delta_decode_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                              A_log: torch.Tensor, dt_bias: torch.Tensor, states: torch.Tensor,
                              state_slots: torch.Tensor, has_initial_state: torch.Tensor,
                              block_v: int | None = None) -> torch.Tensor:
    """gated_delta_decode_ref's contract in one launch: q, k [B, H, dk]; v [B, HV, dv]; a, b [B, HV]; A_log,
    dt_bias [HV]; states [num_slots, HV, dk, dv] fp32 (updated in place at state_slots [B]; zeros where not
    has_initial_state [B]) -> o [B, HV, dv] in v's dtype. Rows may be strided (slices of a projection)."""
    B, H, dk = q.shape
    HV, dv = v.shape[1], v.shape[2]
    assert HV % H == 0 and k.shape == q.shape and states.dtype == torch.float32, (q.shape, v.shape, states.dtype)
    assert states.shape[1:] == (HV, dk, dv) and states.stride(-1) == 1, states.shape
    q, k, v, a, b = (_last_dim_contiguous(t) for t in (q, k, v, a, b))
    o = torch.empty(B, HV, dv, dtype=v.dtype, device=v.device)
    if B == 0:
        return o
    bv = block_v or configs.decode_block_v(B, HV, dv)
    grid = (B, HV, triton.cdiv(dv, bv))
    _decode_kernel[grid](q, k, v, a, b, A_log, dt_bias, states, state_slots, has_initial_state, o,
                         q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                         a.stride(0), b.stride(0), states.stride(0), states.stride(1), states.stride(2),
                         o.stride(0), o.stride(1), dk ** -0.5, DK=dk, DV=dv, R=HV // H, BK=next_pow2(dk), BV=bv,
                         num_warps=configs.DECODE_NUM_WARPS)
    return o
