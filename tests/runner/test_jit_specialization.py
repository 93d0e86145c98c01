"""An eager step's Triton launches must compile once, not once per batch shape.

Triton keys each compiled variant on its arguments: a pointer 16-byte aligned or not, an integer divisible by
16, equal to 1, or neither. If a step's tensors or counts change those properties from one batch to the next
(a slice of the packed input buffer whose offset follows the token count; the number of sequences; the
block table's width), a new variant compiles in the middle of serving, on the GPU machine's slow host for
seconds. Here the kernels of an eager prefill / mixed step are launched (under the interpreter, with the
launch itself skipped) on ForwardBatches of many shapes, and every kernel must see one specialization.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gyrfalcon.runner.forward_batch import build_forward_batch

triton = pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from gyrfalcon.kernels._specialization import launch_signature  # noqa: E402

try:
    from triton._C.libtriton import native_specialize_impl
except ImportError:  # pragma: no cover - an older Triton
    native_specialize_impl = None

pytestmark = pytest.mark.skipif(native_specialize_impl is None, reason="needs Triton's native_specialize_impl")


@pytest.fixture
def launches(monkeypatch):
    """Record every interpreted launch's specialization per kernel, and skip running it."""
    seen: dict = {}

    def run(self, *args, grid, warmup, **kwargs):
        seen.setdefault(self.fn.__name__, set()).add(launch_signature(self, args, kwargs))
    monkeypatch.setattr(InterpretedFunction, "run", run)
    return seen


def _sched(q_lens, starts, pending, block_size=16):
    """ScheduledRequest stand-ins: q_lens[i] tokens from starts[i]; pending[i]: the last one is in flight."""
    out, last_rows = [], {}
    for i, (q, s, p) in enumerate(zip(q_lens, starts, pending)):
        known = s + q - (1 if p else 0)
        req = SimpleNamespace(request_id=f"r{i}", num_tokens=known, token_ids=lambda lo, hi: list(range(lo, hi)),
                              block_ids=list(range(-(-(s + q) // block_size))))
        if p:
            last_rows[req.request_id] = i
        out.append(SimpleNamespace(request=req, num_new_tokens=q, start=s, sample=True, spec_token_ids=[]))
    return out, last_rows


# Mixed steps of many shapes: odd and even token counts, 1-7 sequences, decoders with tokens in flight,
# block tables 1-9 blocks wide; all with fewer than 256 tokens and queries of at most 512 (one constexpr
# regime of the kernels: fused_qkv_prep's heads per program, prefill attention's tiles).
SHAPES = [
    ([37], [0], [False]),
    ([64], [0], [False]),
    ([5, 1, 1], [0, 40, 17], [False, True, True]),
    ([16, 16, 1, 1, 1, 1], [0, 16, 99, 3, 60, 7], [False, False, True, True, False, True]),
    ([33, 1], [120, 15], [False, True]),
    ([1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5, 130], [True, False, False, False, False, False, False]),
    ([100, 3], [0, 0], [False, False]),
    ([17, 1, 1, 1], [9, 31, 32, 47], [False, True, True, True]),
    ([7], [0], [False]),  # a block table one block wide
    ([1, 3], [250, 0], [True, False]),  # 16 blocks wide
]


def test_eager_step_kernels_specialize_once(launches):
    from gyrfalcon.kernels.activation import silu_and_mul_triton
    from gyrfalcon.kernels.argmax import greedy_argmax_triton
    from gyrfalcon.kernels.fused_qkv_prep import qkv_prep_triton
    from gyrfalcon.kernels.paged_attention import paged_attention_triton
    from gyrfalcon.kernels.rms_norm import rms_norm_triton

    H, KV, D, hidden, inter, V, bs = 4, 2, 16, 64, 96, 300, 16
    kc = torch.zeros(32, bs, KV, D)
    vc = torch.zeros_like(kc)
    cs = torch.zeros(1024, D)
    w_h, qw = torch.ones(hidden), torch.ones(D)
    last_sampled = torch.zeros(16, dtype=torch.int64)
    for q_lens, starts, pending in SHAPES:
        reqs, last_rows = _sched(q_lens, starts, pending)
        fb = build_forward_batch(reqs, bs, torch.device("cpu"), last_rows, last_sampled)
        T = fb.num_tokens
        # Activations come from GEMMs and the allocator (aligned, shape-independent strides); the batch's own
        # tensors come from the packed input buffer.
        x, r = torch.zeros(T, hidden), torch.zeros(T, hidden)
        rms_norm_triton(x, w_h, 1e-6, residual=r)
        qkv = torch.zeros(T, (H + 2 * KV) * D)
        q = qkv_prep_triton(qkv, H, KV, D, fb.positions, cs, D, True, kc, vc, fb.slot_mapping, qw, qw, 1e-6)
        paged_attention_triton(q.view(T, H, D), kc, vc, fb.block_tables, fb.seq_lens, fb.query_start_loc,
                               D ** -0.5, max_query_len=fb.max_query_len)
        silu_and_mul_triton(torch.zeros(T, 2 * inter))
        greedy_argmax_triton(torch.zeros(fb.logits_indices.shape[0], V))
    assert {"_rms_norm_kernel", "_qkv_prep_kernel", "_paged_prefill_kernel", "_silu_and_mul_kernel"} <= set(launches)
    # rms_norm's row count is left specialized: 1, a multiple of 16 and the rest are three variants, all
    # compiled at startup by the decode graphs' batch ladder (1, 2, 4, 8, 16, ...).
    _assert_one_runtime_specialization(launches, {"_rms_norm_kernel": "n_rows"}, constexprs_too=True)


def _assert_one_runtime_specialization(launches, exempt: dict, constexprs_too: bool = False):
    """Per kernel and constexpr combination (the call site and its launch config), one specialization of the
    runtime arguments; exempt: {kernel: argument} left out (a bounded set of variants compiled at startup).
    constexprs_too: also one constexpr combination per kernel."""
    groups: dict = {}
    for name, sigs in launches.items():
        for sig in sigs:
            const = tuple(a for a in sig if a[1] == "tl.constexpr")
            runtime = tuple(a for a in sig if a not in const and exempt.get(name) != a[0])
            groups.setdefault((name, () if constexprs_too else const), set()).add(
                runtime + ((const,) if constexprs_too else ()))
    varied = {key: sorted(sigs, key=str) for key, sigs in groups.items() if len(sigs) > 1}
    assert not varied, "kernels compiled for several batch shapes:\n" + "\n".join(
        f"{key[0]}: " + "; ".join(str([a for a in sig if a not in sigs[0]]) for sig in sigs[1:])
        for key, sigs in varied.items())


def test_forward_batch_tensors_are_16_byte_aligned():
    """Every tensor of a ForwardBatch starts 16-byte aligned, whatever the token, sequence and pending
    counts (each section of the packed buffer is padded)."""
    for q_lens, starts, pending in SHAPES:
        reqs, last_rows = _sched(q_lens, starts, pending)
        fb = build_forward_batch(reqs, 16, torch.device("cpu"), last_rows, torch.zeros(16, dtype=torch.int64))
        for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables",
                     "logits_indices"):
            assert getattr(fb, name).data_ptr() % 16 == 0, (name, q_lens)


def test_eager_decode_kernels_runtime_specialization_once(launches):
    """Decode batches of 1-16 sequences run eagerly (enforce_eager, or a step the graphs do not cover). Their
    launch configs change with the batch by design (splits, rows per program: constexprs, a bounded set);
    within one launch config, the runtime part of a kernel's specialization must not."""
    from gyrfalcon.kernels.decode_attention import (decode_attention_with_prep_triton,
                                                    paged_decode_attention_triton)
    from gyrfalcon.kernels.gemv import norm_gemv_triton

    H, KV, D, hidden, bs = 4, 2, 16, 64, 16
    kc = torch.zeros(64, bs, KV, D)
    vc = torch.zeros_like(kc)
    cs = torch.zeros(2048, D)
    qw = torch.ones(D)
    w = torch.zeros((H + 2 * KV) * D, hidden)
    nw = torch.ones(hidden)
    last_sampled = torch.zeros(16, dtype=torch.int64)
    for B, ctx in [(1, 5), (1, 300), (2, 17), (3, 64), (5, 33), (8, 129), (13, 1), (16, 250)]:
        starts = [ctx + i for i in range(B)]
        reqs, last_rows = _sched([1] * B, starts, [i % 2 == 0 for i in range(B)])
        fb = build_forward_batch(reqs, bs, torch.device("cpu"), last_rows, last_sampled)
        x, r = torch.zeros(B, hidden), torch.zeros(B, hidden)
        qkv, _ = norm_gemv_triton(x, w, nw, r)
        paged_decode_attention_triton(torch.zeros(B, H, D), kc, vc, fb.block_tables, fb.seq_lens, D ** -0.5)
        decode_attention_with_prep_triton(qkv, H, KV, D, fb.positions, cs, D, True, kc, vc, fb.slot_mapping,
                                          fb.block_tables, fb.seq_lens, D ** -0.5, q_norm_weight=qw, k_norm_weight=qw)
    assert {"_norm_gemv_kernel", "_decode_split_kernel"} <= set(launches)
    # norm_gemv's row count M is left specialized: 1, a multiple of 16 and the rest are three variants, all
    # compiled at startup by the decode graphs' batch ladder (1, 2, 4, 8, 16), and M == 1 (a constexpr then)
    # is the batch-1 step.
    _assert_one_runtime_specialization(launches, {"_norm_gemv_kernel": "M"})


def test_gated_delta_prefill_kernels_specialize_once_with_saves(launches):
    """A hybrid model's eager prefill steps, with and without in-step state snapshots (hybrid prefix caching: the
    save table's sections in the packed buffer), over batch shapes: the Gated DeltaNet conv, window and chunk
    kernels compile one variant per constexpr combination (saves or not), and every save tensor is 16-byte
    aligned."""
    from gyrfalcon.kernels.gated_delta import causal_conv1d_triton, gated_delta_prefill_triton

    H, HV, dk, dv, K, bs = 1, 2, 16, 16, 4, 16
    C = 2 * H * dk + HV * dv
    conv, states = torch.zeros(8, K - 1, C), torch.zeros(8, HV, dk, dv)
    conv_snaps, state_snaps = torch.zeros(40, K - 1, C), torch.zeros(40, HV, dk, dv)
    w, A_log, dt_bias = torch.zeros(C, K), torch.zeros(HV), torch.zeros(HV)
    last_sampled = torch.zeros(16, dtype=torch.int64)
    for n, (q_lens, starts, pending) in enumerate(SHAPES):
        reqs, last_rows = _sched(q_lens, starts, pending, bs)
        for i, r in enumerate(reqs):
            r.request.state_slots = {"state": i}
        # Every block boundary inside each row's tokens (none on some shapes), on every other shape.
        saves = [(i, p, len(q_lens) + p // bs) for i, (q, s) in enumerate(zip(q_lens, starts))
                 for p in range(s + 1, s + q + 1) if p % bs == 0] if n % 2 else []
        fb = build_forward_batch(reqs, bs, torch.device("cpu"), last_rows, last_sampled, saves)
        assert (fb.state_saves is None) == (not saves)
        if saves:
            assert fb.state_saves.num_saves == len(saves)
            assert all(t.data_ptr() % 16 == 0 for t in fb.state_saves), q_lens
        T = fb.num_tokens
        init = fb.seq_lens > (fb.query_start_loc[1:] - fb.query_start_loc[:-1])
        proj = torch.zeros(T, C + HV * dv)  # the layer's in_proj output: the conv reads a slice of its rows
        mixed = causal_conv1d_triton(proj[:, :C], w, conv, fb.state_slots, fb.query_start_loc, init, conv_snaps,
                                     fb.state_saves)
        q, k, v = mixed.split([H * dk, H * dk, HV * dv], dim=-1)
        ab = torch.zeros(T, 2 * HV)
        gated_delta_prefill_triton(q.reshape(T, H, dk), k.reshape(T, H, dk), v.reshape(T, HV, dv), ab[:, HV:],
                                   ab[:, :HV], A_log, dt_bias, states, fb.state_slots, fb.query_start_loc, init,
                                   state_snaps, fb.state_saves)
    assert {"_conv_prefill_kernel", "_conv_window_kernel", "_chunk_kernel"} <= set(launches)
    _assert_one_runtime_specialization(launches, {})
