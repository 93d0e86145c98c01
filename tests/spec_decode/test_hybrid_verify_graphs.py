"""Verify steps of hybrid targets through the verify graphs' static inputs (runner/cuda_graph.py): the Gated DeltaNet
layers keep each row's conv window and recurrent state after each verify token in a static scratch, batched on the
device (kernels/gated_delta/position_states.py; the states' kernel triton_position_states.py, here in the
interpreter), and the rollback gathers from it. The batched tracking is held to the one-row rule, one layer's
uniform and one-by-one tracking to each other and to a step of the kept tokens alone. On a CPU the graphs' steps run
eagerly over the padded static inputs (rows padded to the ladder's size, padding rows on the pools' spare slot):
Qwen3-Next and Qwen3.5 keep the engine's greedy outputs without speculation there, with drafts partly rejected at
every depth. tests/gpu/test_hybrid_verify_graphs_gpu.py replays the captured graphs."""

from __future__ import annotations

import pytest
import torch

from checkpoints import make_qwen3_5_checkpoint, make_qwen3_next_checkpoint
from gyrfalcon import LLM
from gyrfalcon.kernels.gated_delta import (conv_position_windows, conv_position_windows_ref,
                                           gated_delta_position_states_ref, gather_initial,
                                           verify_position_states_ref, verify_position_states_triton)
from gyrfalcon.forward_context import forward_context
from gyrfalcon.layers.gated_deltanet import GatedDeltaNet
from gyrfalcon.layers.norm import RMSNorm
from gyrfalcon.runner.forward_batch import ForwardBatch
from gyrfalcon.runner.cuda_graph import CudaGraphRunner
from test_mtp_hybrid import KW, _greedy, _oracle

MAX_NUM_SEQS = 6  # verify ladder 1, 2, 4, 8: the three prompts replay size 4 (one padding row)


def _verify_inputs(B, L, H, HV, dk, dv, seed=1):
    g = torch.Generator().manual_seed(seed)
    # rows strided as the layer's are (column slices of a projection)
    k = torch.randn(B, L, H, dk + 3, generator=g)[..., 3:]
    v = torch.randn(B, L, HV, dv, generator=g)
    a, b = torch.randn(B, L, HV, generator=g), torch.randn(B, L, HV, generator=g)
    A_log, dt_bias = torch.randn(HV, generator=g) * 0.5, torch.randn(HV, generator=g)
    pool = torch.randn(5, HV, dk, dv, generator=g)
    pool[0] = float("nan")  # (a row without an initial state must not read its slot)
    return k, v, a, b, A_log, dt_bias, pool


def test_batched_position_states_equal_the_token_by_token_rule():
    """Rows of one length L (grouped value heads, r = 2), one starting from zeros (has_initial False): every row's
    states and windows after tokens 1..L - 1 equal the one-row reference's, written into a larger buffer."""
    B, L, H, HV, dk, dv, C, K = 3, 4, 2, 4, 8, 8, 12, 4
    k, v, a, b, A_log, dt_bias, pool = _verify_inputs(B, L, H, HV, dk, dv)
    g = torch.Generator().manual_seed(2)
    conv_pool, x = torch.randn(5, K - 1, C, generator=g), torch.randn(B, L, C, generator=g)
    slots, init = torch.tensor([3, 0, 4], dtype=torch.int32), torch.tensor([True, False, True])
    s0, w0 = gather_initial(pool, slots, init), gather_initial(conv_pool, slots, init)
    assert torch.equal(s0[1], torch.zeros(HV, dk, dv)) and torch.equal(s0[2], pool[4])
    states, wins = torch.full((4, L, HV, dk, dv), 7.0), torch.full((4, L, K - 1, C), 7.0)  # (a scratch's B rows)
    verify_position_states_ref(k, v, a, b, A_log, dt_bias, pool, slots, init, states[:B])
    conv_position_windows(x, w0, wins[:B])
    q = torch.randn(B, L, H, dk, generator=g)  # (the one-row rule takes q; the states do not depend on it)
    for i in range(B):
        ref = gated_delta_position_states_ref(q[i], k[i], v[i], a[i], b[i], A_log, dt_bias, s0[i])
        torch.testing.assert_close(states[i, :L - 1], ref[:L - 1], rtol=1e-5, atol=1e-5)
        assert torch.equal(wins[i, :L - 1], conv_position_windows_ref(x[i], w0[i])[:L - 1])
    # nothing written past L - 1 entries or B rows
    assert (states[:, L - 1] == 7).all() and (states[B:] == 7).all() and (wins[B:] == 7).all()


@pytest.mark.parametrize("H, HV, dv, block_v", [(2, 4, 8, None), (1, 3, 40, 16)])
def test_position_states_kernel_matches_reference(H, HV, dv, block_v):
    """triton_position_states.py (the interpreter on a CPU) against the plain-torch reference: grouped value heads,
    a dv that is not a power of two over several value tiles, a row from zeros, the slot pool left alone."""
    pytest.importorskip("triton")
    B, L, dk = 3, 4, 8
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # (compiled kernels want CUDA tensors)
    k, v, a, b, A_log, dt_bias, pool = (t.to(dev) for t in _verify_inputs(B, L, H, HV, dk, dv, seed=3))
    slots = torch.tensor([3, 0, 4], dtype=torch.int32, device=dev)
    init = torch.tensor([True, False, True], device=dev)
    want = verify_position_states_ref(k, v, a, b, A_log, dt_bias, pool, slots, init,
                                      torch.zeros(B, L - 1, HV, dk, dv, device=dev))
    before = pool.clone()
    got = verify_position_states_triton(k, v, a, b, A_log, dt_bias, pool, slots, init,
                                        torch.zeros(B, L - 1, HV, dk, dv, device=dev), block_v=block_v)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(pool[1:], before[1:]) and pool[0].isnan().all()


def test_dispatch_falls_back_to_the_reference_when_the_kernel_fails(monkeypatch):
    """A kernel that cannot be built on this GPU: the step still gets the reference's states, and later steps go
    straight to the reference."""
    import gyrfalcon.kernels.gated_delta as gd

    B, L, H, HV, dk, dv = 2, 3, 1, 2, 8, 8
    k, v, a, b, A_log, dt_bias, pool = _verify_inputs(B, L, H, HV, dk, dv, seed=5)
    slots, init = torch.tensor([1, 2], dtype=torch.int32), torch.tensor([True, True])
    calls = []

    def broken(*args, **kw):
        calls.append(1)
        raise RuntimeError("no kernel image")
    monkeypatch.setattr(gd, "use_triton", lambda t: True)
    monkeypatch.setattr(gd, "verify_position_states_triton", broken)
    monkeypatch.setattr(gd, "_POSITION_STATES_TRITON_FAILED", False)
    want = verify_position_states_ref(k, v, a, b, A_log, dt_bias, pool, slots, init, torch.zeros(B, L - 1, HV, dk, dv))
    for _ in range(2):
        got = gd.verify_position_states(k, v, a, b, A_log, dt_bias, pool, slots, init, torch.zeros(B, L - 1, HV, dk, dv))
        assert torch.equal(got, want)
    assert calls == [1] and gd._POSITION_STATES_TRITON_FAILED


def test_uniform_and_one_by_one_tracking_roll_back_alike():
    """One Gated DeltaNet layer runs the same verify step of three rows (one starting at position 0) as a uniform
    step (batched on the device, into the static scratch) and as a ragged one (one by one, a host read): the same
    outputs and final slots; rolling rows 0 and 2 back to 1 and 3 kept tokens gives the same slots both ways, the
    slots that a step of only those tokens leaves."""
    torch.manual_seed(0)
    hidden, H, HV, dk, dv, K, B, L = 32, 2, 4, 8, 8, 4, 3, 4
    layer = GatedDeltaNet(hidden, H, HV, dk, dv, K, 1e-6, layer_idx=0)
    for p in layer.parameters():
        p.data.normal_(0, 0.3)
    layer.bind_input_norm(RMSNorm(hidden))
    layer.verify_len = L
    layer.allocate_verify_scratch(4, torch.device("cpu"))
    C = layer.conv_dim
    pools = (torch.randn(5, K - 1, C), torch.randn(5, HV, dk, dv))
    x = torch.randn(B * L, hidden)
    slots = torch.tensor([3, 0, 4], dtype=torch.int32)
    rows, keep = torch.tensor([0, 2]), torch.tensor([1, 3])

    seq_lens = [9, L, 6]

    def run(caches, x, lens, seq_lens, slots, uniform_query_len=0):
        T, n = x.shape[0], len(lens)
        fb = ForwardBatch(input_ids=torch.zeros(T, dtype=torch.int64), positions=torch.zeros(T),
                          slot_mapping=torch.full((T,), -1), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                          query_start_loc=torch.tensor([0] + lens).cumsum(0).to(torch.int32),
                          block_tables=torch.zeros(n, 1, dtype=torch.int32), logits_indices=torch.arange(T),
                          is_decode=False, max_query_len=max(lens), max_seq_len=max(seq_lens), num_seqs=n,
                          uniform_query_len=uniform_query_len, state_slots=slots)
        with forward_context(fb, caches):
            return layer(fb.positions, x, None)

    def step(uniform_query_len):
        caches = [tuple(t.clone() for t in pools)]
        out = run(caches, x, [L] * B, seq_lens, slots, uniform_query_len)
        final = tuple(t.clone() for t in caches[0])
        # (both write the static scratch; only the one-by-one path needs a sequence -> entry map)
        assert layer.position_states[1].data_ptr() == layer.verify_scratch[1].data_ptr()
        batched = layer.position_states[2] is None
        layer.rollback(caches, rows, slots[rows].long(), keep)
        return out, final, caches[0], batched

    out_u, final_u, rolled_u, batched_u = step(L)
    out_r, final_r, rolled_r, batched_r = step(0)
    assert batched_u and not batched_r
    torch.testing.assert_close(out_u[0], out_r[0])
    for a, b in zip(final_u + rolled_u, final_r + rolled_r):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(rolled_u[1][3], final_u[1][3])  # (a rollback that changed the slot)
    for i, n in zip(rows.tolist(), keep.tolist()):  # a step of the kept tokens only
        caches = [tuple(t.clone() for t in pools)]
        run(caches, x[i * L:i * L + n], [n], [seq_lens[i] - L + n], slots[i:i + 1])
        slot = int(slots[i])
        torch.testing.assert_close(rolled_u[0][slot], caches[0][0][slot], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rolled_u[1][slot], caches[0][1][slot], rtol=1e-4, atol=1e-4)
    assert torch.equal(rolled_u[1][0], final_u[1][0])  # row 1 (slot 0) was not rolled back


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    path = make_qwen3_next_checkpoint(tmp_path_factory.mktemp("q3n") / "t")
    return path, _greedy(LLM(str(path), **KW))


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    path = make_qwen3_5_checkpoint(tmp_path_factory.mktemp("q35") / "t", moe=False)
    return path, _greedy(LLM(str(path), **KW))


def _graph_parity(path, ref, k):
    """Greedy generation (two rounds: the second from prefix-cache hits) with oracle drafts spoiled at a cycling
    depth, the target's decode and verify steps through a CudaGraphRunner's static inputs, the GDN layers writing
    the static scratch the runner would allocate for a GPU's verify ladder, and their forward's rollback pointer
    dropped as a replay would."""
    kw = dict(KW, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=3 * (1 + k))
    llm = LLM(str(path), **kw, speculative_config={"method": "ngram", "num_speculative_tokens": k,
                                                   "prompt_lookup_min": 1, "prompt_lookup_max": 2})
    r = llm.engine.runner
    r.proposer = _oracle(ref, k)
    layers = [m for m in r.model.modules() if isinstance(m, GatedDeltaNet)]
    assert layers and all(m.verify_len == 1 + k for m in layers)
    for m in layers:
        m.allocate_verify_scratch(8, r.device)  # (the ladder's largest size)
    assert r._verify_graphs_capturable()
    g = CudaGraphRunner(r.model, r.kv_caches, MAX_NUM_SEQS, kw["max_model_len"], r.block_size, r.device,
                        r.last_sampled, query_lens=(1, 1 + k),
                        state_padding_slot=r.cache_plan.padding_slot(r.num_state_slots))
    # On a GPU a replay runs no Python: what GatedDeltaNet.forward points rollback at during the step is not set
    # then. Emulate that here (the CPU runs the padded step's forward): the runner itself must point rollback at the
    # scratch after each verify step.
    forward = g._forward

    def forward_like_a_replay(fb, src):
        out = forward(fb, src)
        for m in layers:
            m.position_states = None
        return out
    g._forward = forward_like_a_replay
    verify_rows = []
    run = g.run

    def spy(sched_reqs, last_rows=None):
        out = run(sched_reqs, last_rows)
        if g.query_len_of(sched_reqs) == 1 + k:
            verify_rows.append(len(sched_reqs))
            # The kept states are the static scratch's first rows (padded batch), not per-step tensors.
            conv, state, row_map = layers[0].position_states
            assert row_map is None and state.data_ptr() == layers[0].verify_scratch[1].data_ptr()
        return out
    g.run = spy
    r.graph_runner = g
    assert _greedy(llm, rounds=2) == ref
    s = llm.engine.spec_stats
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens  # some drafts rejected, some kept
    # Verify steps of all three rows (padded to 4: a padding row on the spare slot) ran through the static inputs.
    assert 3 in verify_rows, verify_rows


@pytest.mark.parametrize("k", [1, 2, 3])
def test_qwen3_next_verify_graph_path_keeps_greedy_outputs(qwen3_next, k):
    _graph_parity(*qwen3_next, k)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_qwen3_5_verify_graph_path_keeps_greedy_outputs(qwen3_5, k):
    _graph_parity(*qwen3_5, k)


def test_the_scratch_budget_bounds_the_verify_ladder(qwen3_next):
    """The scratch takes at most VERIFY_SCRATCH_SHARE of the GPU: the largest ladder size that fits (Qwen3-Next-80B
    at k = 3, 216 MiB a row, on a 141 GB card: 24 rows, not the ladder's 128), none when one row does not fit;
    the verify graphs stop at those rows while decode graphs keep their ladder."""
    from gyrfalcon.runner.cuda_graph import capture_sizes
    from gyrfalcon.runner.model_runner import VERIFY_SCRATCH_SHARE, verify_scratch_rows

    ladder = capture_sizes(128)
    assert verify_scratch_rows(ladder, 3 * 36 * 2 * 2**20, VERIFY_SCRATCH_SHARE * 141e9) == 24
    assert verify_scratch_rows(ladder, 1, 1e12) == 128 and verify_scratch_rows(ladder, 10, 5) == 0
    path, _ = qwen3_next
    r = LLM(str(path), **dict(KW, max_num_seqs=16),
            speculative_config={"method": "ngram", "num_speculative_tokens": 2}).engine.runner
    g = CudaGraphRunner(r.model, r.kv_caches, 16, KW["max_model_len"], r.block_size, r.device, r.last_sampled,
                        query_lens=(1, 3), state_padding_slot=r.cache_plan.padding_slot(r.num_state_slots),
                        max_verify_rows=4)
    assert g.sizes_by_q[3] == [1, 2, 4] and g.sizes_by_q[1][-1] == 16
    layer = next(m for m in r.model.modules() if isinstance(m, GatedDeltaNet))
    assert layer.allocate_verify_scratch(4, r.device) == 4 * layer.verify_scratch_row_bytes()
