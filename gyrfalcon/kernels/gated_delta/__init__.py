"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention): the ops of one layer's step, each over a ragged batch
whose requests keep their state in slots of per-layer pools.

T tokens, B sequences (sequence i's rows query_start_loc[i]:query_start_loc[i + 1]), C = 2 * H * dk + HV * dv
conv channels, H key heads of dk, HV value heads of dv (HV a multiple of H), K the conv width:
- causal_conv1d: x [T, C] -> silu(depthwise causal conv) [T, C]; conv_states [num_slots, K - 1, C] (a request's
  first chunk starts from zeros, has_initial_state False; later chunks from its slot; the last K - 1 inputs are
  written back). With StateSaves (saves.py: hybrid prefix caching's in-step snapshots) the windows after the saved
  token rows go to conv_snapshots [num_snapshots, K - 1, C] too.
- causal_conv1d_update: the same for one token per sequence (decode), x [B, C] (has_initial_state False for a
  one-token prompt's step).
- gated_delta_prefill: q, k [T, H, dk], v [T, HV, dv], a, b [T, HV], A_log, dt_bias [HV] -> o [T, HV, dv]:
  gating (g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)), L2 norm of q and k, the chunked gated delta
  rule (chunks of 64) from each slot's state (or zeros) in states [num_slots, HV, dk, dv] fp32, final states
  written back; with StateSaves the states after the saved token rows go to state_snapshots
  [num_snapshots, HV, dk, dv] fp32 (inside the walk: no chunk ends there).
- gated_delta_decode: the same for one token per sequence, the state updated in place (on the GPU one launch:
  gating, norm, update and output).
- gated_rms_norm: the output norm rms_norm(o) * w * silu(z).
- gated_delta_position_states_ref / conv_position_windows_ref: one sequence's recurrent state and conv window
  after each of its tokens (a speculative verify row of 1 + k tokens: the runner rolls a slot back to the state
  after the last accepted token, layers/gated_deltanet.py). Plain torch: L <= 17 tokens of a few rows.
- verify_position_states / conv_position_windows (position_states.py): the same for B rows of one uniform
  length L (a verify step), batched with no host read, into [B, L - 1, ...] buffers (a verify graph's static
  scratch): the recurrent states from the rows' slots (read before the step's prefill writes them), the windows
  from the rows' windows before the step (gather_initial). On CUDA the states come from triton_position_states
  (one launch).

The plain-torch references (naive.py) loop over sequences on the host, so a step through them cannot be captured
in a CUDA graph; on CUDA tensors the Triton kernels run instead (triton_*.py: shapes only, no host sync):
triton_decode (the whole decode step in one launch), triton_conv (the conv in two launches: the conv, then the
windows written back; its update in one), triton_norm (one launch), triton_chunk (the chunked rule over the ragged
batch in one launch). Launch shapes in configs.py.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from gyrfalcon.kernels.common import use_triton
from gyrfalcon.kernels.gated_delta.naive import (CHUNK_SIZE, causal_conv1d_ref, causal_conv1d_update_ref,
                                                 chunk_gated_delta_rule_ref, conv_position_windows_ref,
                                                 gated_delta_decode_ref, gated_delta_position_states_ref,
                                                 gated_delta_prefill_ref, gated_rms_norm_ref, gdn_gating_ref,
                                                 recurrent_gated_delta_rule_ref)
from gyrfalcon.kernels.gated_delta.position_states import (conv_position_windows, gather_initial,
                                                           verify_position_states_ref)
from gyrfalcon.kernels.gated_delta.saves import StateSaves, save_table, state_saves_from_table
from gyrfalcon.kernels.gated_delta.triton_chunk import gated_delta_prefill_triton
from gyrfalcon.kernels.gated_delta.triton_conv import causal_conv1d_triton, causal_conv1d_update_triton
from gyrfalcon.kernels.gated_delta.triton_decode import gated_delta_decode_triton
from gyrfalcon.kernels.gated_delta.triton_norm import gated_rms_norm_triton
from gyrfalcon.kernels.gated_delta.triton_position_states import verify_position_states_triton


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor, state_slots: torch.Tensor,
                  query_start_loc: torch.Tensor, has_initial_state: torch.Tensor,
                  conv_snapshots: Optional[torch.Tensor] = None, saves: Optional[StateSaves] = None) -> torch.Tensor:
    if use_triton(x):
        return causal_conv1d_triton(x, weight, conv_states, state_slots, query_start_loc, has_initial_state,
                                    conv_snapshots, saves)
    return causal_conv1d_ref(x, weight, conv_states, state_slots, query_start_loc, has_initial_state, conv_snapshots,
                             saves)


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor,
                         state_slots: torch.Tensor, has_initial_state: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        return causal_conv1d_update_triton(x, weight, conv_states, state_slots, has_initial_state)
    return causal_conv1d_update_ref(x, weight, conv_states, state_slots, has_initial_state)


def gated_delta_prefill(q, k, v, a, b, A_log, dt_bias, states, state_slots, query_start_loc,
                        has_initial_state, state_snapshots: Optional[torch.Tensor] = None,
                        saves: Optional[StateSaves] = None) -> torch.Tensor:
    if use_triton(v):
        return gated_delta_prefill_triton(q, k, v, a, b, A_log, dt_bias, states, state_slots, query_start_loc,
                                          has_initial_state, state_snapshots, saves)
    return gated_delta_prefill_ref(q, k, v, a, b, A_log, dt_bias, states, state_slots, query_start_loc,
                                   has_initial_state, state_snapshots, saves)


def gated_delta_decode(q, k, v, a, b, A_log, dt_bias, states, state_slots, has_initial_state) -> torch.Tensor:
    if use_triton(v):
        return gated_delta_decode_triton(q, k, v, a, b, A_log, dt_bias, states, state_slots, has_initial_state)
    return gated_delta_decode_ref(q, k, v, a, b, A_log, dt_bias, states, state_slots, has_initial_state)


_POSITION_STATES_TRITON_FAILED = False


def verify_position_states(k, v, a, b, A_log, dt_bias, states, state_slots, has_initial_state,
                           out: torch.Tensor) -> torch.Tensor:
    """Every uniform verify step of a speculating hybrid model goes through here: if the Triton kernel cannot be
    built or launched on this GPU, the batched plain-torch reference (no host read either, so verify graphs still
    capture it) takes over with a warning rather than failing the step. The first call is the eager warm-up before
    any capture, so a failure never happens inside one."""
    global _POSITION_STATES_TRITON_FAILED
    if use_triton(v) and not _POSITION_STATES_TRITON_FAILED:
        try:
            return verify_position_states_triton(k, v, a, b, A_log, dt_bias, states, state_slots,
                                                 has_initial_state, out)
        except Exception as e:  # compilation / launch failure, not a data error
            _POSITION_STATES_TRITON_FAILED = True
            logging.getLogger(__name__).warning("Triton verify-position-states kernel unavailable (%s: %s); using "
                                                "the torch reference", type(e).__name__, e)
    return verify_position_states_ref(k, v, a, b, A_log, dt_bias, states, state_slots, has_initial_state, out)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_triton(x):
        return gated_rms_norm_triton(x, z, weight, eps)
    return gated_rms_norm_ref(x, z, weight, eps)


__all__ = ["CHUNK_SIZE", "StateSaves", "causal_conv1d", "causal_conv1d_ref", "causal_conv1d_triton",
           "causal_conv1d_update", "causal_conv1d_update_ref", "causal_conv1d_update_triton",
           "chunk_gated_delta_rule_ref", "conv_position_windows", "conv_position_windows_ref", "gated_delta_decode",
           "gated_delta_decode_ref", "gated_delta_decode_triton", "gated_delta_position_states_ref",
           "gated_delta_prefill", "gated_delta_prefill_ref", "gated_delta_prefill_triton", "gated_rms_norm",
           "gated_rms_norm_ref", "gated_rms_norm_triton", "gather_initial", "gdn_gating_ref",
           "recurrent_gated_delta_rule_ref", "save_table", "state_saves_from_table", "verify_position_states",
           "verify_position_states_ref", "verify_position_states_triton"]
