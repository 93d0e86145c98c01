"""The per-token state tracking of a speculative verify step over rows of one uniform length L = 1 + k, batched:
no host read and no data-dependent shape, so a captured verify graph can hold it (layers/gated_deltanet.py).

A verify step runs each row's L tokens like a short prefill chunk and leaves the slot at the state after the last
draft; if the target then rejects drafts, the runner sets the slot to the state after an earlier token. These ops
write the conv window and the recurrent state after tokens 1..L - 1 of every row into [B, L - 1, ...] buffers
(the state after token L is the slot's own, so it is not kept), which a rollback gathers from on the device.

verify_position_states_ref is the plain-torch reference of triton_position_states.py's kernel (the one-row
naive.gated_delta_position_states_ref is the oracle both are held to): L - 1 elementwise passes over
[B, HV, dk, dv], each a few reads and writes of every row's state, where the kernel reads each state once and
writes the L - 1 results. The conv windows are small ([K - 1, C] a token): plain torch on every device.
"""

from __future__ import annotations

import torch

from gyrfalcon.kernels.gated_delta.naive import _gva_expand, _l2norm, gdn_gating_ref


def gather_initial(pool: torch.Tensor, slots: torch.Tensor, has_initial_state: torch.Tensor) -> torch.Tensor:
    """pool[slots] ([B, ...], a copy), zeros where not has_initial_state [B] (a row starting at position 0, or a
    graph's padding row: its slot may hold anything). Taken before the step's ops update the pool in place."""
    got = pool[slots.long()]
    keep = has_initial_state.view(-1, *([1] * (got.dim() - 1)))
    return torch.where(keep, got, torch.zeros((), dtype=got.dtype, device=got.device))


def verify_position_states_ref(k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                               A_log: torch.Tensor, dt_bias: torch.Tensor, states: torch.Tensor,
                               state_slots: torch.Tensor, has_initial_state: torch.Tensor,
                               out: torch.Tensor) -> torch.Tensor:
    """k [B, L, H, dk]; v [B, L, HV, dv]; a, b [B, L, HV]; A_log, dt_bias [HV]; states [num_slots, HV, dk, dv] fp32
    (each row's state before its first token at state_slots [B], zeros where not has_initial_state [B]; read only:
    call it before the step's prefill updates the slots) -> out [B, >= L - 1, HV, dk, dv] fp32, entry j of row i
    the state after its token j + 1 (q is not needed: it reads the state, it does not change it). Written in
    place and returned."""
    L, HV = v.shape[1], v.shape[2]
    g, beta = gdn_gating_ref(a, b, A_log, dt_bias)  # [B, L, HV] fp32
    decay = g.exp()
    kn = _l2norm(_gva_expand(k.float(), HV))  # [B, L, HV, dk]
    S = gather_initial(states, state_slots, has_initial_state).float()
    for t in range(L - 1):
        S = S * decay[:, t, :, None, None]
        # delta = beta (v - S^T k): [B, HV, dv]
        delta = (v[:, t].float() - torch.einsum("bhkv,bhk->bhv", S, kn[:, t])) * beta[:, t, :, None]
        S = S + kn[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t].copy_(S)
    return out


def conv_position_windows(x: torch.Tensor, window0: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """x [B, L, C] (the conv's raw input rows of each row's tokens); window0 [B, K - 1, C] (each row's window
    before its first token) -> out [B, >= L - 1, K - 1, C], entry j of row i the last K - 1 inputs up to its
    token j + 1 (in out's dtype). Written in place and returned."""
    L, K1 = x.shape[1], window0.shape[1]
    full = torch.cat([window0.to(x.dtype), x], dim=1)  # [B, K - 1 + L, C]
    # unfold: [B, L + 1, C, K - 1], window s = full[:, s:s + K - 1]; the one after token j + 1 starts at j + 1.
    wins = full.unfold(1, K1, 1)[:, 1:L].transpose(2, 3)
    out[:, :L - 1].copy_(wins)
    return out
