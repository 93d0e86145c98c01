"""Gated DeltaNet: the linear-attention layer of Qwen3-Next (three of every four layers), in a decoder layer's
attention slot.

    x = norm(stream)
    q | k | v | z = in_proj_qkvz(x);  b | a = in_proj_ba(x)
    q | k | v = silu(causal_conv1d(q | k | v))          per-request conv window (K - 1 tokens) in a state slot
    o = gated_delta_rule(q, k, v, g(a), beta(b))         per-request recurrent state [HV, dk, dv] fp32
    out = out_proj(rms_norm(o) * w * silu(z))

Qwen3-Next's checkpoint groups in_proj_qkvz's rows per key head ([H, q dk | k dk | v r*dv | z r*dv], r = HV / H)
and in_proj_ba's likewise ([H, b r | a r]); the loader reorders them into flat [q | k | v | z] and [b | a] once,
so the conv reads one contiguous slice of the projection every step. Qwen3.5's checkpoint is flat already, in four
tensors (flat_projections): in_proj_qkv [2 H dk + HV dv, hidden] and in_proj_z [HV dv, hidden] are the two shards
of in_proj_qkvz, in_proj_b and in_proj_a [HV, hidden] those of in_proj_ba: the same weights, the same forward. The state lives in this layer's entry of the "state" cache group (cache_spec.LinearStateSpec): a conv
pool [num_slots, K - 1, C] in the model's dtype and a recurrent pool [num_slots, HV, dk, dv] in fp32; the step's
rows find their slot in ForwardBatch.state_slots. A request whose step starts at position 0 starts from zeros
(its slot may hold a finished request's state), later prefill chunks and decode steps from the slot.

Tensor parallelism (docs/parallelism.md): rank r holds key heads [r H / tp, (r + 1) H / tp) and the value heads they
own (r * HV / tp onwards: a key head's r value heads are consecutive in both layouts), so every head's recurrence
stays on one rank and nothing is communicated until out_proj (row-parallel, the block's one all-reduce). Its rows of
every projection (q, k, v, z, b, a), its conv channels (q | k | v of its heads), A_log / dt_bias of its value heads;
the output norm's weight is per head dim, replicated. Its state pools hold its heads only (kv_cache_spec is built
from the local counts), and snapshot copies move whole slots, the same on every rank.

Speculative decoding (verify_len = 1 + k, set by the runner): a verify row runs its 1 + k tokens like a short
prefill chunk, which leaves the slot at the state after the last draft. The step also keeps, for each row, the conv
window [K - 1, C] and recurrent state [HV, dk, dv] after each of its first k tokens (the one after token 1 + k is
the slot's own), from the slot's state before the step and the step's own conv inputs and k / v / a / b; rollback
then sets rows' slots to the state after their n-th token, a gather on the device, once the runner knows how many
drafts were accepted. Two ways to keep them, chosen per step:
- uniform verify steps (every row 1 + k tokens: ForwardBatch.uniform_query_len, what the verify graphs run):
  batched over rows with no host read and static shapes, between the conv and the prefill
  (kernels/gated_delta/position_states.py; the states in one launch on CUDA, triton_position_states.py), into
  the static scratch that allocate_verify_scratch made for the verify graph ladder ([rows, k, ...]; a larger
  eager step allocates its own), so the verify step can be a captured CUDA graph;
- other steps with verify rows (mixed with prefill chunks, eager): the continuing sequences of 2..1 + k tokens
  one by one (a host read of the sequence bounds), packed the same way with a map from sequence to entry.
The kept states live until the next step (the runner rolls back before it launches one).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from torch import nn

from gyrfalcon.cache_spec import LinearStateSpec
from gyrfalcon.forward_context import get_forward_context
from gyrfalcon.kernels.gated_delta import (causal_conv1d, causal_conv1d_update, conv_position_windows,
                                           conv_position_windows_ref, gated_delta_decode,
                                           gated_delta_position_states_ref, gated_delta_prefill, gated_rms_norm,
                                           gather_initial, verify_position_states)
from gyrfalcon.distributed import as_tensor, shard_size, tp_rank, tp_size
from gyrfalcon.layers.linear import Linear, MergedLinear, RowParallelLinear
from gyrfalcon.layers.norm import RMSNorm
from gyrfalcon.layers.norm_linear import NormLinear, project_out
from gyrfalcon.layers.quantization import fp8_scope


class GroupedHeadsLinear(Linear):
    """A projection whose checkpoint rows come grouped per key head: [H, seg_0 | seg_1 | ...] (segment widths
    `segments`), kept here as flat [seg_0 of every head | seg_1 of every head | ...]. Tensor parallel: this rank's
    key heads' groups (num_groups: the local count), a contiguous block of the checkpoint's rows."""

    def __init__(self, in_features: int, num_groups: int, segments: Sequence[int]) -> None:
        super().__init__(in_features, num_groups * sum(segments))
        self.num_groups, self.segments = num_groups, tuple(segments)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if self.quant_block is not None:
            raise NotImplementedError("FP8 block-quantized Gated DeltaNet input projections are not supported yet.")
        rows = param.shape[0]
        if loaded.dim() != 2 or loaded.shape[0] != rows * tp_size() or loaded.shape[1] != param.shape[1]:
            raise ValueError(f"Shape mismatch: parameter {tuple(param.shape)} (of {tp_size()} ranks) vs checkpoint "
                             f"{tuple(loaded.shape)}.")
        loaded = loaded.narrow(0, tp_rank() * rows, rows) if tp_size() > 1 else as_tensor(loaded)
        grouped = loaded.view(self.num_groups, sum(self.segments), -1)
        param.data.copy_(torch.cat([part.reshape(-1, loaded.shape[-1])
                                    for part in grouped.split(self.segments, dim=1)]))


class FlatQKVZLinear(MergedLinear):
    """Qwen3.5's flat in_proj_qkvz: shard "qkv" is the checkpoint's in_proj_qkv [q (H dk) | k (H dk) | v (HV dv)],
    shard "z" in_proj_z [HV dv]. Tensor parallel: this rank's heads of each of q, k, v (three blocks of the qkv
    tensor, not one) and of z."""

    def __init__(self, in_features: int, qkv_parts: Sequence[int], z_rows: int) -> None:
        """qkv_parts: the full (q, k, v) row counts."""
        self.qkv_parts = tuple(qkv_parts)
        layout = {"qkv": (sum(shard_size(n, "the GDN heads") for n in qkv_parts), tp_rank()),
                  "z": (shard_size(z_rows, "linear_num_value_heads"), tp_rank())}
        super().__init__(in_features, {"qkv": sum(qkv_parts), "z": z_rows}, False, layout)

    def _rank_slice(self, loaded: torch.Tensor, shard_id) -> torch.Tensor:
        if shard_id != "qkv" or tp_size() == 1:
            return super()._rank_slice(loaded, shard_id)
        if loaded.shape[0] != sum(self.qkv_parts):
            raise ValueError(f"Shape mismatch for shard 'qkv': {sum(self.qkv_parts)} rows expected, checkpoint has "
                             f"{tuple(loaded.shape)}.")
        return narrow_parts(loaded, self.qkv_parts)


def narrow_parts(loaded, parts: Sequence[int]) -> torch.Tensor:
    """This rank's slice of each consecutive block of dim 0 (block sizes `parts`), concatenated: the q | k | v
    channels of its heads, from a tensor (or CheckpointSlice) holding every head's."""
    pieces, off = [], 0
    for n in parts:
        local = n // tp_size()
        pieces.append(loaded.narrow(0, off + tp_rank() * local, local))
        off += n
    return torch.cat(pieces)


class GatedRMSNorm(nn.Module):
    """rms_norm(x) * weight * silu(z) over the last dim (the weight plain, initialized to ones)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """x, z: [..., dim] -> [..., dim]"""
        return gated_rms_norm(x, z, self.weight, self.eps)


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet layer: (hidden, residual) stream -> stream (layers/norm_linear.py), its input norm the
    decoder layer's (bind_input_norm)."""

    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel: int, eps: float, layer_idx: int, flat_projections: bool = False) -> None:
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_value_heads ({num_v_heads}) must be a multiple of linear_num_key_heads "
                             f"({num_k_heads}).")
        full_key_dim, full_value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        # This rank's heads (all of them at world size 1): key heads split, each with its r value heads.
        num_k_heads = shard_size(num_k_heads, "linear_num_key_heads")
        num_v_heads = shard_size(num_v_heads, "linear_num_value_heads")
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = conv_kernel
        self.layer_idx = layer_idx
        r = num_v_heads // num_k_heads
        # The conv channels' full (q, k, v) blocks, for narrowing the checkpoint's conv weight and in_proj_qkv.
        self.conv_parts = (full_key_dim, full_key_dim, full_value_dim)
        if flat_projections:
            self.in_proj_qkvz = FlatQKVZLinear(hidden_size, self.conv_parts, full_value_dim)
            # Never FP8: Qwen3.5's FP8 releases leave in_proj_b / in_proj_a unquantized, and [HV, hidden] shards of
            # HV < 128 rows could not stack 128-row scale blocks anyway.
            with fp8_scope(None):
                self.in_proj_ba = MergedLinear(hidden_size, {"b": full_value_dim // head_v_dim,
                                                             "a": full_value_dim // head_v_dim})
        else:
            self.in_proj_qkvz = GroupedHeadsLinear(hidden_size, num_k_heads,
                                                   (head_k_dim, head_k_dim, r * head_v_dim, r * head_v_dim))
            self.in_proj_ba = GroupedHeadsLinear(hidden_size, num_k_heads, (r, r))
        # Depthwise, no bias: only its weight [C, 1, K] is used (the checkpoint's conv1d.weight).
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False)
        self.conv1d.weight.requires_grad_(False)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(num_v_heads), requires_grad=False)
        # (CausalLM.load_weights hands these three their checkpoint tensors through shard_loader: this rank's part)
        self.conv1d.weight.shard_loader = self._load_conv_weight
        self.dt_bias.shard_loader = self.A_log.shard_loader = _load_value_head_param
        self.norm = GatedRMSNorm(head_v_dim, eps)
        self.out_proj = RowParallelLinear(full_value_dim, hidden_size)
        self.norm_in: Optional[NormLinear] = None
        self.verify_len = 0  # 1 + k under speculative decoding (module docstring)
        # The last step's kept states: (conv windows [M, k, K - 1, C], states [M, k, HV, dk, dv] fp32, the step's
        # sequence -> entry map [B] int64, or None where entry = sequence), or None when it kept none.
        self.position_states: Optional[tuple] = None
        # The static [rows, k, ...] pair the verify graphs write into (allocate_verify_scratch), or None.
        self.verify_scratch: Optional[tuple] = None

    def _load_conv_weight(self, param: nn.Parameter, loaded) -> None:
        """The checkpoint's conv1d.weight [C, 1, K] (every head's q | k | v channels) -> this rank's channels."""
        if loaded.dim() != 3 or loaded.shape[0] != sum(self.conv_parts) or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(f"Shape mismatch for conv1d.weight: {sum(self.conv_parts)} channels x "
                             f"{tuple(param.shape[1:])} expected, checkpoint has {tuple(loaded.shape)}.")
        param.data.copy_(narrow_parts(loaded, self.conv_parts) if tp_size() > 1 else as_tensor(loaded))

    def kv_cache_spec(self, cache_dtype: str) -> LinearStateSpec:
        """Per request: the conv window [K - 1, C] in the model's dtype (cache_dtype, the KV cache's, may be FP8:
        not for a state that is read back every step) and the recurrent state [HV, dk, dv] in fp32."""
        dtype = str(self.conv1d.weight.dtype).replace("torch.", "")
        return LinearStateSpec((self.conv_kernel - 1, self.conv_dim),
                               (self.num_v_heads, self.head_k_dim, self.head_v_dim), dtype, "float32")

    def verify_scratch_row_bytes(self) -> int:
        """One verify row's share of allocate_verify_scratch: k conv windows and k fp32 states."""
        k = self.verify_len - 1
        return k * ((self.conv_kernel - 1) * self.conv_dim * self.conv1d.weight.element_size()
                    + self.num_v_heads * self.head_k_dim * self.head_v_dim * 4)

    def allocate_verify_scratch(self, rows: int, device: torch.device) -> int:
        """The static [rows, k, K - 1, C] conv windows and [rows, k, HV, dk, dv] fp32 states that uniform verify
        steps of up to `rows` rows write (rows: the verify graph ladder's largest size). Returns its bytes: k
        states of HV * dk * dv * 4 bytes per row, e.g. 3 x 2 MiB per row for Qwen3-Next-80B's 32 x 128 x 128 at
        k = 3, so 384 MiB per layer at 64 rows (13.5 GiB over its 36 GDN layers at tensor-parallel size 1)."""
        k = self.verify_len - 1
        conv = torch.empty((rows, k, self.conv_kernel - 1, self.conv_dim), dtype=self.conv1d.weight.dtype,
                           device=device)
        state = torch.empty((rows, k, self.num_v_heads, self.head_k_dim, self.head_v_dim), dtype=torch.float32,
                            device=device)
        self.verify_scratch = (conv, state)
        return conv.numel() * conv.element_size() + state.numel() * state.element_size()

    def bind_input_norm(self, norm: RMSNorm) -> None:
        # The norm runs on its own: in_proj_qkvz and in_proj_ba both read its output.
        self.norm_in = NormLinear(norm)

    def forward(self, positions: torch.Tensor, hidden: Optional[torch.Tensor],
                residual: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
        """positions: [T] (unused: the recurrence has no positions); (hidden, residual): the stream."""
        n = self.norm_in(hidden, residual)
        ctx = get_forward_context()
        batch, (conv_states, states) = ctx.batch, ctx.kv_caches[self.layer_idx]
        slots = batch.state_slots
        T = n.y.shape[0]
        qkvz = self.in_proj_qkvz(n.y)  # [T, C + value_dim]: q | k | v (the conv's input) | z
        mixed, z = qkvz.split([self.conv_dim, self.value_dim], dim=-1)
        b, a = self.in_proj_ba(n.y).split([self.num_v_heads, self.num_v_heads], dim=-1)  # [T, HV] each
        w = self.conv1d.weight.squeeze(1)  # [C, K]
        qsl = batch.query_start_loc
        # [B]: a step that starts past position 0 continues the request's state (its earlier chunks' or tokens');
        # one at position 0 (a new or recomputed request, a one-token prompt's decode-shaped step) starts at zero.
        has_initial = batch.seq_lens > (qsl[1:] - qsl[:-1])
        # Hybrid prefix caching: states at block boundaries inside this step's chunks, written by the prefill ops
        # into the snapshot pools (a one-token chunk that ends on a boundary takes that path too).
        saves, (conv_snaps, state_snaps) = ctx.state_saves(self.layer_idx)
        decode = batch.is_decode and saves is None
        self.position_states = None
        B, L = len(slots) if slots is not None else 0, self.verify_len
        tracking = L > 1 and not batch.is_decode
        uniform = tracking and batch.uniform_query_len == L and T == B * L
        if uniform:  # the rows' windows before the step (the conv below updates the slots in place)
            conv0 = gather_initial(conv_states, slots, has_initial)
        else:
            tracked = self._tracked(batch, has_initial) if tracking else []
            before = [(conv_states[slot].clone(), states[slot].clone()) for _, slot, _, _ in tracked]
        raw = mixed
        if decode:
            mixed = causal_conv1d_update(mixed, w, conv_states, slots, has_initial)
        else:
            mixed = causal_conv1d(mixed, w, conv_states, slots, qsl, has_initial, conv_snaps, saves)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(T, self.num_k_heads, self.head_k_dim)
        k = k.reshape(T, self.num_k_heads, self.head_k_dim)
        v = v.reshape(T, self.num_v_heads, self.head_v_dim)
        if uniform:  # (from the slots' states before the prefill below writes the step's final ones)
            conv_out, state_out = self._verify_buffers(B, conv_states.dtype)
            conv_position_windows(raw.view(B, L, -1), conv0, conv_out)
            verify_position_states(k.view(B, L, self.num_k_heads, -1), v.view(B, L, self.num_v_heads, -1),
                                   a.view(B, L, -1), b.view(B, L, -1), self.A_log, self.dt_bias, states, slots,
                                   has_initial, state_out)
            self.position_states = (conv_out, state_out, None)
        if decode:
            o = gated_delta_decode(q, k, v, a, b, self.A_log, self.dt_bias, states, slots, has_initial)
        else:
            o = gated_delta_prefill(q, k, v, a, b, self.A_log, self.dt_bias, states, slots, qsl, has_initial,
                                    state_snaps, saves)
        if not uniform and tracked:
            self.position_states = self._pack_tracked(tracked, before, raw, q, k, v, a, b, B, conv_states.dtype)
        o = self.norm(o, z.reshape(T, self.num_v_heads, self.head_v_dim))  # [T, HV, dv]
        return project_out(self.out_proj, o.reshape(T, self.value_dim), n)

    def _verify_buffers(self, rows: int, conv_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """[rows, k, ...] conv windows and states of a uniform verify step: the static scratch's first rows (what a
        captured graph writes), or new tensors for a step larger than the scratch (eager)."""
        if self.verify_scratch is not None and rows <= self.verify_scratch[0].shape[0]:
            return self.verify_scratch[0][:rows], self.verify_scratch[1][:rows]
        k = self.verify_len - 1
        dev = self.A_log.device
        return (torch.empty((rows, k, self.conv_kernel - 1, self.conv_dim), dtype=conv_dtype, device=dev),
                torch.empty((rows, k, self.num_v_heads, self.head_k_dim, self.head_v_dim), dtype=torch.float32,
                            device=dev))

    def _tracked(self, batch, has_initial: torch.Tensor):
        """[(sequence, slot, first row, end row)] of the continuing sequences of 2..verify_len tokens (a host read:
        only steps that are not uniform verify steps, which run eagerly)."""
        bounds = batch.query_start_loc.tolist()
        slots, init = batch.state_slots.tolist(), has_initial.tolist()
        return [(i, slots[i], bounds[i], bounds[i + 1]) for i in range(len(slots))
                if init[i] and 2 <= bounds[i + 1] - bounds[i] <= self.verify_len]

    def _pack_tracked(self, tracked, before, raw, q, k, v, a, b, num_seqs: int, conv_dtype: torch.dtype) -> tuple:
        """The one-by-one tracked sequences' states after each of their tokens but the last, packed as a uniform
        step's ([M, k, ...], entry m's first L_m - 1 filled) with the sequence -> entry map rollback reads."""
        conv_out, state_out = self._verify_buffers(len(tracked), conv_dtype)
        row_map = torch.full((num_seqs,), -1, dtype=torch.int64)
        for m, ((i, _, s0, e0), (conv0, state0)) in enumerate(zip(tracked, before)):
            n = e0 - s0 - 1
            conv_out[m, :n] = conv_position_windows_ref(raw[s0:e0], conv0)[:n].to(conv_dtype)
            state_out[m, :n] = gated_delta_position_states_ref(q[s0:e0], k[s0:e0], v[s0:e0], a[s0:e0], b[s0:e0],
                                                               self.A_log, self.dt_bias, state0)[:n]
            row_map[i] = m
        return conv_out, state_out, row_map.to(self.A_log.device)

    def replayed_verify(self) -> None:
        """A uniform verify step replayed as a CUDA graph: its kernels wrote the per-token states into the static
        scratch's first rows (row i: the step's sequence i), but this forward's Python, which points rollback at
        them, ran only at capture (and every eager step since reset it). Point rollback there again."""
        if self.verify_scratch is not None:
            self.position_states = (self.verify_scratch[0], self.verify_scratch[1], None)

    def rollback(self, kv_caches, rows: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor) -> None:
        """Set each `slots[j]` to the state after the first keep[j] tokens (1..k) of sequence rows[j] of the last
        step (a verify row whose drafts past keep[j] - 1 were rejected): one gather per pool on the device.
        rows, slots, keep: [M] int64 on the pools' device. Every such row was kept by the step (a verify row
        continues its request and has 2..1 + k tokens); a step that kept none leaves the slots alone."""
        if self.position_states is None:
            return
        conv_src, state_src, row_map = self.position_states
        entries = rows if row_map is None else row_map[rows]
        conv_states, states = kv_caches[self.layer_idx]
        conv_states[slots] = conv_src[entries, keep - 1].to(conv_states.dtype)
        states[slots] = state_src[entries, keep - 1]


def _load_value_head_param(param: nn.Parameter, loaded) -> None:
    """A per-value-head vector (A_log, dt_bias) [HV] -> this rank's value heads."""
    n = param.shape[0]
    if loaded.dim() != 1 or loaded.shape[0] != n * tp_size():
        raise ValueError(f"Shape mismatch: {n * tp_size()} value heads expected, checkpoint has {tuple(loaded.shape)}.")
    param.data.copy_(loaded.narrow(0, tp_rank() * n, n) if tp_size() > 1 else as_tensor(loaded))
