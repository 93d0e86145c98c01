"""Plain-torch Gated DeltaNet ops (the CPU path and the future kernels' oracle); shapes in the package docstring.

Math follows the Gated DeltaNet paper (arXiv 2412.06464) as Qwen3-Next runs it: fp32 throughout the recurrence,
q and k L2-normalized (x * rsqrt(sum(x^2) + 1e-6)), q scaled by dk^-0.5, value head h reading key head h // r
(r = HV / H). Per token, with the state S [dk, dv] of one value head:
    S <- exp(g_t) S;  delta = beta_t (v_t - S^T k_t);  S <- S + k_t delta^T;  o_t = S^T q_t.
The chunked form computes the same over chunks of C tokens with a few matmuls per chunk (see
chunk_gated_delta_rule_ref).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from gyrfalcon.kernels.gated_delta.saves import StateSaves

CHUNK_SIZE = 64
L2_EPS = 1e-6


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def _gva_expand(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    """[..., H, d] -> [..., HV, d]: value head h reads key head h // (HV / H)."""
    r = num_v_heads // x.shape[-2]
    return x if r == 1 else x.repeat_interleave(r, dim=-2)


def _prep_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """q, k [..., H, dk] (any dtype) -> fp32 [..., HV, dk]: L2-normalized, q scaled by dk^-0.5."""
    q = _l2norm(_gva_expand(q.float(), num_v_heads))
    k = _l2norm(_gva_expand(k.float(), num_v_heads))
    return q * q.shape[-1] ** -0.5, k


def _seq_bounds(query_start_loc: torch.Tensor) -> List[int]:
    return [int(x) for x in query_start_loc.tolist()]


def _saves_by_seq(saves: Optional[StateSaves]) -> Dict[int, List[Tuple[int, int]]]:
    """{sequence: [(token row, snapshot id), ...] in row order} (empty without saves)."""
    out: Dict[int, List[Tuple[int, int]]] = {}
    if saves is not None:
        for i, row, sid in zip(saves.seqs.tolist(), saves.rows.tolist(), saves.ids.tolist()):
            out.setdefault(i, []).append((row, sid))
    return out


def gdn_gating_ref(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                   dt_bias: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """a, b: [T, HV]; A_log, dt_bias: [HV] -> (g, beta), fp32 [T, HV] each:
    g = -exp(A_log) * softplus(a + dt_bias) (the log of the state's decay this token), beta = sigmoid(b)."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.float().sigmoid()


def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor,
                      state_slots: torch.Tensor, query_start_loc: torch.Tensor,
                      has_initial_state: torch.Tensor, conv_snapshots: Optional[torch.Tensor] = None,
                      saves: Optional[StateSaves] = None) -> torch.Tensor:
    """Depthwise causal conv over a ragged batch, then SiLU.

    x: [T, C] (sequence i's tokens at rows query_start_loc[i]:query_start_loc[i + 1]); weight: [C, K];
    conv_states: [num_slots, K - 1, C], the last K - 1 inputs of each request before this step, read where
    has_initial_state [B] (else zeros: a request's first chunk) and overwritten with the window after this step;
    state_slots: [B]. With saves (kernels/gated_delta/saves.py), conv_snapshots [num_snapshots, K - 1, C] row
    ids[j] gets the window after token row rows[j]: the last K - 1 inputs up to it, some from the old window when
    the row is within K - 2 tokens of its chunk's start. Returns silu(conv) [T, C] in x's dtype (the conv in
    fp32)."""
    K = weight.shape[-1]
    out = torch.empty_like(x)
    w = weight.float().unsqueeze(1)  # [C, 1, K]: F.conv1d's depthwise layout
    bounds = _seq_bounds(query_start_loc)
    slots, init = state_slots.tolist(), has_initial_state.tolist()
    by_seq = _saves_by_seq(saves)
    for i, slot in enumerate(slots):
        s, e = bounds[i], bounds[i + 1]
        if e == s:
            continue
        prev = conv_states[slot] if init[i] else x.new_zeros(K - 1, x.shape[1])
        window = torch.cat([prev.to(x.dtype), x[s:e]], dim=0)  # [K - 1 + L, C]: row m is input m - (K - 1)
        y = F.conv1d(window.float().t().unsqueeze(0), w, groups=x.shape[1])[0].t()  # [L, C]
        out[s:e] = F.silu(y).to(x.dtype)
        for row, sid in by_seq.get(i, ()):
            n = row + 1 - s  # tokens of the chunk up to the row: the window after them is rows n..n + K - 2
            conv_snapshots[sid] = window[n:n + K - 1].to(conv_snapshots.dtype)
        conv_states[slot] = window[-(K - 1):].to(conv_states.dtype)
    return out


def _initial(pool: torch.Tensor, idx: torch.Tensor, has_initial_state: torch.Tensor) -> torch.Tensor:
    """pool[idx], zeros where not has_initial_state (a slot may hold a finished request's state)."""
    got = pool[idx]
    keep = has_initial_state.view(-1, *([1] * (got.dim() - 1)))
    return torch.where(keep, got, torch.zeros((), dtype=got.dtype, device=got.device))


def causal_conv1d_update_ref(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor,
                             state_slots: torch.Tensor, has_initial_state: torch.Tensor) -> torch.Tensor:
    """One token per sequence (decode): x [B, C], weight [C, K], conv_states [num_slots, K - 1, C] (read where
    has_initial_state [B], else zeros: a one-token prompt; shifted by one token in place), state_slots [B]
    -> silu(conv) [B, C] in x's dtype."""
    idx = state_slots.long()
    window = torch.cat([_initial(conv_states, idx, has_initial_state).to(x.dtype), x.unsqueeze(1)], dim=1)
    y = (window.float() * weight.float().t().unsqueeze(0)).sum(1)
    conv_states[idx] = window[:, 1:].to(conv_states.dtype)
    return F.silu(y).to(x.dtype)


def _chunk_rule_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor, chunk_size: int,
                    save_at: Tuple[int, ...] = ()) -> Tuple[torch.Tensor, torch.Tensor, List[torch.Tensor]]:
    """One sequence, chunked. q, k: [L, HV, dk] fp32 (normalized, q scaled); v: [L, HV, dv]; g, beta: [L, HV];
    state: [HV, dk, dv] fp32; save_at: ascending token indices -> (o [L, HV, dv], final state, the states after
    each token of save_at).

    Within a chunk of C tokens, with G = cumsum(g) and D[i, j] = exp(G_i - G_j) for j <= i (0 above):
    the per-token updates' corrections solve the unit lower-triangular system (I + A) U = beta * v and
    (I + A) W = beta * k * exp(G), A[i, j] = beta_i (k_i . k_j) D[i, j] for j < i (the UT transform); then with
    the state S at the chunk's start: v' = U - W S, o = (q * exp(G)) S + ((q k^T) * D) v', and
    S <- exp(G_C) S + (k * exp(G_C - G))^T v'.
    v'_i depends on tokens <= i only, so the state after token p of the chunk is the same update cut at p:
    exp(G_p) S + (k_{<=p} * exp(G_p - G_{<=p}))^T v'_{<=p}; the chunks stay where they are (a step's outputs do not
    depend on which states it saves)."""
    q, k, v = (x.transpose(0, 1) for x in (q, k, v.float()))  # [HV, L, d]
    g, beta = g.t(), beta.t()  # [HV, L]
    L = q.shape[1]
    out = torch.empty_like(v)
    S = state
    saved: List[torch.Tensor] = []
    for c0 in range(0, L, chunk_size):
        c1 = min(c0 + chunk_size, L)
        qc, kc, vc, bc = q[:, c0:c1], k[:, c0:c1], v[:, c0:c1], beta[:, c0:c1, None]
        G = g[:, c0:c1].cumsum(-1)  # [HV, C]
        n = c1 - c0
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        D = (G[:, :, None] - G[:, None, :]).masked_fill(~lower, float("-inf")).exp()  # [HV, C, C]
        A = (bc * kc) @ kc.transpose(-1, -2) * D
        U = torch.linalg.solve_triangular(A, bc * vc, upper=False, unitriangular=True)
        W = torch.linalg.solve_triangular(A, bc * kc * G.exp()[..., None], upper=False, unitriangular=True)
        v_new = U - W @ S
        out[:, c0:c1] = (qc * G.exp()[..., None]) @ S + ((qc @ kc.transpose(-1, -2)) * D) @ v_new
        for p in save_at:
            if c0 <= p < c1:
                n = p - c0 + 1
                Gp = G[:, n - 1:n]
                saved.append(S * Gp.exp()[..., None]
                             + (kc[:, :n] * (Gp - G[:, :n]).exp()[..., None]).transpose(-1, -2) @ v_new[:, :n])
        G_end = G[:, -1:]
        S = S * G_end.exp()[..., None] + (kc * (G_end - G).exp()[..., None]).transpose(-1, -2) @ v_new
    return out.transpose(0, 1), S, saved


def chunk_gated_delta_rule_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, states: torch.Tensor, state_slots: torch.Tensor,
                               query_start_loc: torch.Tensor, has_initial_state: torch.Tensor,
                               state_snapshots: Optional[torch.Tensor] = None, saves: Optional[StateSaves] = None,
                               chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """The gated delta rule over a ragged batch of prefill chunks (any lengths, one launch later).

    q, k: [T, H, dk] (raw: normalized here); v: [T, HV, dv]; g, beta: [T, HV] fp32 (gdn_gating_ref);
    states: [num_slots, HV, dk, dv] fp32, each sequence's initial state read from its slot where
    has_initial_state [B] (else zeros) and its final state written back; state_slots: [B];
    query_start_loc: [B + 1]. With saves (kernels/gated_delta/saves.py), state_snapshots
    [num_snapshots, HV, dk, dv] row ids[j] gets the state after token row rows[j]. Returns o [T, HV, dv] in v's
    dtype."""
    HV = v.shape[1]
    qn, kn = _prep_qk(q, k, HV)
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    bounds = _seq_bounds(query_start_loc)
    slots, init = state_slots.tolist(), has_initial_state.tolist()
    by_seq = _saves_by_seq(saves)
    for i, slot in enumerate(slots):
        s, e = bounds[i], bounds[i + 1]
        if e == s:
            continue
        s0 = states[slot].float() if init[i] else states.new_zeros(states.shape[1:], dtype=torch.float32)
        mine = by_seq.get(i, ())
        out[s:e], final, saved = _chunk_rule_one(qn[s:e], kn[s:e], v[s:e], g[s:e], beta[s:e], s0, chunk_size,
                                                 tuple(row - s for row, _ in mine))
        for (_, sid), st in zip(mine, saved):
            state_snapshots[sid] = st.to(state_snapshots.dtype)
        states[slot] = final.to(states.dtype)
    return out.to(v.dtype)


def recurrent_gated_delta_rule_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                   beta: torch.Tensor, states: torch.Tensor, state_slots: torch.Tensor,
                                   has_initial_state: torch.Tensor) -> torch.Tensor:
    """One token per sequence (decode): q, k [B, H, dk]; v [B, HV, dv]; g, beta [B, HV] fp32; states
    [num_slots, HV, dk, dv] fp32, read at state_slots [B] where has_initial_state [B] (else zeros) and updated in
    place. Returns o [B, HV, dv] in v's dtype."""
    HV = v.shape[1]
    qn, kn = _prep_qk(q, k, HV)
    idx = state_slots.long()
    S = _initial(states, idx, has_initial_state).float() * g.exp()[..., None, None]  # [B, HV, dk, dv]
    delta = (v.float() - (S * kn[..., None]).sum(-2)) * beta[..., None]  # [B, HV, dv]
    S = S + kn[..., None] * delta[..., None, :]
    states[idx] = S.to(states.dtype)
    return (S * qn[..., None]).sum(-2).to(v.dtype)


def gated_delta_prefill_ref(q, k, v, a, b, A_log, dt_bias, states, state_slots, query_start_loc,
                            has_initial_state, state_snapshots=None, saves: Optional[StateSaves] = None,
                            chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """Gating, then the chunked rule (shapes of gdn_gating_ref and chunk_gated_delta_rule_ref)."""
    g, beta = gdn_gating_ref(a, b, A_log, dt_bias)
    return chunk_gated_delta_rule_ref(q, k, v, g, beta, states, state_slots, query_start_loc, has_initial_state,
                                      state_snapshots, saves, chunk_size)


def gated_delta_decode_ref(q, k, v, a, b, A_log, dt_bias, states, state_slots, has_initial_state) -> torch.Tensor:
    """Gating, then one recurrent step per sequence (the fused decode kernel's contract: gating, L2 norm, the
    update in place and the output)."""
    g, beta = gdn_gating_ref(a, b, A_log, dt_bias)
    return recurrent_gated_delta_rule_ref(q, k, v, g, beta, states, state_slots, has_initial_state)


def gated_rms_norm_ref(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The GDN output norm: x, z [..., dv] -> rms_norm(x) * weight * silu(z) [..., dv] in x's dtype (fp32 math;
    the weight is plain, not (1 + w))."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (y * F.silu(z.float())).to(x.dtype)


def gated_delta_position_states_ref(q, k, v, a, b, A_log, dt_bias, state: torch.Tensor) -> torch.Tensor:
    """The recurrent state after each token of ONE sequence (a speculative verify row: 1 + k tokens), so a
    rejected draft's state can be undone by picking an earlier one. q, k [L, H, dk]; v [L, HV, dv]; a, b [L, HV];
    state [HV, dk, dv] fp32 (before the first token) -> [L, HV, dk, dv] fp32, entry j the state after token j
    (the token-by-token recurrence of recurrent_gated_delta_rule_ref; entry L - 1 is the step's final state)."""
    g, beta = gdn_gating_ref(a, b, A_log, dt_bias)
    qn, kn = _prep_qk(q, k, v.shape[1])
    S = state.float()
    out = torch.empty((v.shape[0],) + tuple(S.shape), dtype=torch.float32, device=v.device)
    for t in range(v.shape[0]):
        S = S * g[t].exp()[:, None, None]
        delta = (v[t].float() - (S * kn[t][..., None]).sum(-2)) * beta[t][:, None]  # [HV, dv]
        S = S + kn[t][..., None] * delta[:, None, :]
        out[t] = S
    return out


def conv_position_windows_ref(x: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """The conv window after each token of ONE sequence: x [L, C] (the conv's raw input rows), window [K - 1, C]
    (before the first token) -> [L, K - 1, C], entry j the last K - 1 inputs up to token j."""
    K1 = window.shape[0]
    full = torch.cat([window.to(x.dtype), x], dim=0)  # [K - 1 + L, C]
    return torch.stack([full[j + 1:j + 1 + K1] for j in range(x.shape[0])])
