"""The Gated DeltaNet Triton kernels against their plain-torch references (kernels/gated_delta/naive.py), under the
interpreter on a CPU: ragged batches (lengths not multiples of 64, an empty chunk, chunks shorter than the conv
window), slots out of order ([3, 0, 5, ...]), states carried in and written back, GVA ratios 1 and 2, fp32 and bf16
inputs over fp32 states, rows sliced out of a wider projection; in-step state snapshots (StateSaves) at several
token rows per sequence, checked against the references run on the prefixes alone."""

import pytest
import torch

from gyrfalcon.kernels.gated_delta import (causal_conv1d_ref, causal_conv1d_triton, causal_conv1d_update_ref,
                                           causal_conv1d_update_triton, gated_delta_decode_ref,
                                           gated_delta_decode_triton, gated_delta_prefill_ref,
                                           gated_delta_prefill_triton, gated_rms_norm_ref, gated_rms_norm_triton,
                                           save_table, state_saves_from_table)
from kernels_testutil import DEVICE, TOL, requires_triton

DTYPES = [torch.float32, torch.bfloat16]
NUM_SLOTS = 7
# fp32 state tolerance: both sides run the same fp32 recurrence, in a different summation order.
STATE_TOL = dict(atol=2e-5, rtol=2e-5)


def _rows(T, width, dtype, offset=3):
    """[T, width] rows sliced out of a wider projection output (row stride > width), as the layer's q / k / v /
    z / conv input are."""
    return torch.randn(T, width + 2 * offset, device=DEVICE).to(dtype)[:, offset:offset + width]


def _qsl(lens):
    return torch.tensor([0] + list(lens), device=DEVICE).cumsum(0).to(torch.int32)


def _slot_pool(shape, dtype, init_mask, slots):
    """A pool of random slot contents, NaN in the slots of sequences that start from zeros (has_initial_state
    False): a kernel that reads them poisons its output."""
    pool = torch.randn(NUM_SLOTS, *shape, device=DEVICE).to(dtype)
    for s, keep in zip(slots.tolist(), init_mask.tolist()):
        if not keep:
            pool[s] = float("nan")
    return pool


def _assert_pools(got, want):
    """Every slot: written ones close (NaN where the reference leaves NaN: untouched), the rest bit for bit."""
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got.nan_to_num(0.0), want.nan_to_num(0.0), **STATE_TOL)


# ---- the decode step ---------------------------------------------------------------------------------------------

def _token_inputs(B, H, HV, dk, dv, dtype):
    q = _rows(B, H * dk, dtype).view(B, H, dk)
    k = _rows(B, H * dk, dtype).view(B, H, dk)
    v = _rows(B, HV * dv, dtype).view(B, HV, dv)
    a = 3 * torch.randn(B, HV, device=DEVICE)
    a[0, 0], a[-1, -1] = 30.0, -30.0  # softplus past its threshold, and far below 0 (softplus = exp(a))
    a, b = a.to(dtype), _rows(B, HV, dtype)
    A_log = torch.rand(HV, device=DEVICE).clamp_min(0.05).log()
    dt_bias = torch.randn(HV, device=DEVICE)
    return q, k, v, a, b, A_log, dt_bias


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,HV", [(2, 2), (2, 4)], ids=["gva1", "gva2"])
def test_decode_step_matches_reference(dtype, H, HV):
    """Three sequences in slots [3, 0, 5], the middle one at position 0 (its slot NaN: it must start from zeros);
    dv = 24 over 16-column tiles (a partial tile)."""
    B, dk, dv = 3, 32, 24
    slots = torch.tensor([3, 0, 5], dtype=torch.int32, device=DEVICE)
    init = torch.tensor([True, False, True], device=DEVICE)
    q, k, v, a, b, A_log, dt_bias = _token_inputs(B, H, HV, dk, dv, dtype)
    pool = _slot_pool((HV, dk, dv), torch.float32, init, slots)
    want_pool, got_pool = pool.clone(), pool.clone()
    want = gated_delta_decode_ref(q, k, v, a, b, A_log, dt_bias, want_pool, slots, init)
    got = gated_delta_decode_triton(q, k, v, a, b, A_log, dt_bias, got_pool, slots, init, block_v=16)
    assert got.shape == (B, HV, dv) and got.dtype == dtype
    torch.testing.assert_close(got, want, **TOL[dtype])
    _assert_pools(got_pool, want_pool)
    assert not got_pool[0].isnan().any()  # the zero-started sequence wrote its fresh state


@requires_triton
def test_decode_steps_chain_and_default_tiles():
    """Five steps in a row through the kernel (its launch-shape rule picking the tiles) track five reference steps:
    the state written back is the one read next."""
    B, H, HV, dk, dv = 2, 1, 2, 16, 16
    slots = torch.tensor([4, 1], dtype=torch.int32, device=DEVICE)
    init = torch.tensor([True, True], device=DEVICE)
    pool = 0.1 * torch.randn(NUM_SLOTS, HV, dk, dv, device=DEVICE)
    want_pool, got_pool = pool.clone(), pool.clone()
    for _ in range(5):
        q, k, v, a, b, A_log, dt_bias = _token_inputs(B, H, HV, dk, dv, torch.float32)
        want = gated_delta_decode_ref(q, k, v, a, b, A_log, dt_bias, want_pool, slots, init)
        got = gated_delta_decode_triton(q, k, v, a, b, A_log, dt_bias, got_pool, slots, init)
        torch.testing.assert_close(got, want, **TOL[torch.float32])
    _assert_pools(got_pool, want_pool)
    assert not torch.equal(got_pool, pool)


# ---- the chunked prefill ------------------------------------------------------------------------------------------

@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,HV", [(2, 2), (1, 2)], ids=["gva1", "gva2"])
def test_prefill_matches_reference(dtype, H, HV):
    """Chunks of 70, 1, 0, 130 and 5 tokens (one, two and three 64-token chunks, all partial at the end; an empty
    one leaves its slot alone) in slots [3, 0, 5, 2, 1], two of them continuing from their slots' states."""
    lens, dk, dv = [70, 1, 0, 130, 5], 16, 24
    qsl = _qsl(lens)
    T = sum(lens)
    slots = torch.tensor([3, 0, 5, 2, 1], dtype=torch.int32, device=DEVICE)
    init = torch.tensor([True, False, False, True, True], device=DEVICE)
    q, k, v, a, b, A_log, dt_bias = _token_inputs(T, H, HV, dk, dv, dtype)
    pool = _slot_pool((HV, dk, dv), torch.float32, init, slots)
    want_pool, got_pool = pool.clone(), pool.clone()
    want = gated_delta_prefill_ref(q, k, v, a, b, A_log, dt_bias, want_pool, slots, qsl, init)
    # gva1: two 16-column value tiles, the second partial; gva2: one 32-column tile (the launcher's choice).
    got = gated_delta_prefill_triton(q, k, v, a, b, A_log, dt_bias, got_pool, slots, qsl, init,
                                     block_v=16 if H == HV else None)
    assert got.shape == (T, HV, dv) and got.dtype == dtype
    torch.testing.assert_close(got, want, **TOL[dtype])
    _assert_pools(got_pool, want_pool)
    assert torch.isnan(got_pool[5]).all()  # the empty chunk's slot


@requires_triton
def test_prefill_near_equal_keys():
    """Keys within 1% of each other, beta near 1 and no decay: A's entries near 1 below the diagonal, where the
    Neumann series of (I + A)^-1 would cancel catastrophically (its terms reach ~1e10 here); the kernel's inverse must
    stay at fp32 accuracy."""
    T, dk, dv = 100, 16, 16
    k = torch.randn(1, 1, dk, device=DEVICE) + 0.01 * torch.randn(T, 1, dk, device=DEVICE)
    q, v = torch.randn(T, 1, dk, device=DEVICE), torch.randn(T, 1, dv, device=DEVICE)
    a, b = torch.full((T, 1), 5.0, device=DEVICE), torch.full((T, 1), 8.0, device=DEVICE)
    A_log, dt_bias = torch.full((1,), -12.0, device=DEVICE), torch.zeros(1, device=DEVICE)
    qsl, slots = _qsl([T]), torch.zeros(1, dtype=torch.int32, device=DEVICE)
    init = torch.zeros(1, dtype=torch.bool, device=DEVICE)
    want_pool, got_pool = torch.zeros(1, 1, dk, dv, device=DEVICE), torch.zeros(1, 1, dk, dv, device=DEVICE)
    want = gated_delta_prefill_ref(q, k, v, a, b, A_log, dt_bias, want_pool, slots, qsl, init)
    got = gated_delta_prefill_triton(q, k, v, a, b, A_log, dt_bias, got_pool, slots, qsl, init)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_pool, want_pool, atol=1e-5, rtol=1e-5)


@requires_triton
def test_prefill_then_decode_continue_the_state():
    """A 67-token prompt through the chunked kernel, then three decode steps through the decode kernel, track the
    references step for step: both kernels agree on the state's layout in the slot."""
    H, HV, dk, dv = 1, 2, 16, 16
    slots, init = torch.tensor([2], dtype=torch.int32, device=DEVICE), torch.tensor([False], device=DEVICE)
    q, k, v, a, b, A_log, dt_bias = _token_inputs(67, H, HV, dk, dv, torch.float32)
    want_pool, got_pool = torch.zeros(3, HV, dk, dv, device=DEVICE), torch.zeros(3, HV, dk, dv, device=DEVICE)
    qsl = _qsl([67])
    gated_delta_prefill_ref(q, k, v, a, b, A_log, dt_bias, want_pool, slots, qsl, init)
    gated_delta_prefill_triton(q, k, v, a, b, A_log, dt_bias, got_pool, slots, qsl, init)
    init = ~init
    for _ in range(3):
        q, k, v, a, b, _, _ = _token_inputs(1, H, HV, dk, dv, torch.float32)
        want = gated_delta_decode_ref(q, k, v, a, b, A_log, dt_bias, want_pool, slots, init)
        got = gated_delta_decode_triton(q, k, v, a, b, A_log, dt_bias, got_pool, slots, init)
        torch.testing.assert_close(got, want, **TOL[torch.float32])
    _assert_pools(got_pool, want_pool)


def _saves(triples, lens):
    """StateSaves for (sequence, token index in the sequence's chunk, snapshot id) triples, through the runner's
    host table (rows as the batch numbers them)."""
    qsl = _qsl(lens)
    table = save_table([(i, int(qsl[i]) + t, sid) for i, t, sid in triples], qsl.cpu().numpy())
    return state_saves_from_table(torch.from_numpy(table).to(DEVICE), len(lens), len(triples))


# Chunks of 130, 0, 70 and 9 tokens in slots [3, 0, 5, 2]; saves at several tokens of each non-empty one (in no
# particular order): chunk ends (63, 127), a chunk's first token (64, 0), its last (129, 8), mid-chunk (70, 5), the
# first tokens (0, 1, 2: windows still partly from the slot or zeros).
SAVE_LENS = [130, 0, 70, 9]
SAVE_TRIPLES = [(0, 129, 6), (0, 15, 0), (0, 63, 2), (0, 64, 3), (0, 127, 5), (2, 0, 7), (2, 69, 8), (2, 40, 1),
                (3, 5, 4), (3, 8, 9), (3, 1, 10), (0, 70, 11), (3, 2, 12)]
SAVE_INIT = [True, False, False, True]
NUM_SNAPSHOTS = 14


@pytest.mark.parametrize("H,HV", [(2, 2), (1, 2)], ids=["gva1", "gva2"])
def test_prefill_saves_are_the_states_of_the_prefixes(H, HV):
    """The reference's in-step snapshots are the final states of the same sequences cut after the saved token (each
    prefix run on its own from the same initial state); saving changes no output and no final state."""
    dk, dv = 16, 24
    qsl = _qsl(SAVE_LENS)
    slots = torch.tensor([3, 0, 5, 2], dtype=torch.int32, device=DEVICE)
    init = torch.tensor(SAVE_INIT, device=DEVICE)
    q, k, v, a, b, A_log, dt_bias = _token_inputs(sum(SAVE_LENS), H, HV, dk, dv, torch.float32)
    pool = _slot_pool((HV, dk, dv), torch.float32, init, slots)
    plain_pool, saved_pool = pool.clone(), pool.clone()
    snaps = torch.full((NUM_SNAPSHOTS, HV, dk, dv), float("nan"), device=DEVICE)
    plain = gated_delta_prefill_ref(q, k, v, a, b, A_log, dt_bias, plain_pool, slots, qsl, init)
    got = gated_delta_prefill_ref(q, k, v, a, b, A_log, dt_bias, saved_pool, slots, qsl, init, snaps,
                                  _saves(SAVE_TRIPLES, SAVE_LENS))
    assert torch.equal(got, plain) and torch.equal(saved_pool.isnan(), plain_pool.isnan())
    assert torch.equal(saved_pool.nan_to_num(0.0), plain_pool.nan_to_num(0.0))
    for i, t, sid in SAVE_TRIPLES:
        s = int(qsl[i])
        one = pool[slots[i].long()].clone().unsqueeze(0)
        rows = slice(s, s + t + 1)
        gated_delta_prefill_ref(q[rows], k[rows], v[rows], a[rows], b[rows], A_log, dt_bias, one,
                                torch.zeros(1, dtype=torch.int32, device=DEVICE), _qsl([t + 1]), init[i:i + 1])
        torch.testing.assert_close(snaps[sid], one[0], **STATE_TOL)
    assert snaps[13].isnan().all()  # an id no save names


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,HV", [(2, 2), (1, 2)], ids=["gva1", "gva2"])
def test_prefill_saves_match_reference(dtype, H, HV):
    """The kernel's in-step snapshots against the reference's (ragged chunks of 130, 0, 70, 9 tokens, 2 to 5 saves
    each at chunk ends, chunk starts and mid-chunk, two sequences from their slots' states); outputs and final states
    as without saves."""
    dk, dv = 16, 24
    qsl = _qsl(SAVE_LENS)
    slots = torch.tensor([3, 0, 5, 2], dtype=torch.int32, device=DEVICE)
    init = torch.tensor(SAVE_INIT, device=DEVICE)
    q, k, v, a, b, A_log, dt_bias = _token_inputs(sum(SAVE_LENS), H, HV, dk, dv, dtype)
    pool = _slot_pool((HV, dk, dv), torch.float32, init, slots)
    want_pool, got_pool, plain_pool = pool.clone(), pool.clone(), pool.clone()
    snaps = torch.full((NUM_SNAPSHOTS, HV, dk, dv), float("nan"), device=DEVICE)
    want_snaps, got_snaps = snaps.clone(), snaps.clone()
    saves = _saves(SAVE_TRIPLES, SAVE_LENS)
    want = gated_delta_prefill_ref(q, k, v, a, b, A_log, dt_bias, want_pool, slots, qsl, init, want_snaps, saves)
    got = gated_delta_prefill_triton(q, k, v, a, b, A_log, dt_bias, got_pool, slots, qsl, init, got_snaps, saves,
                                     block_v=16 if H == HV else None)
    plain = gated_delta_prefill_triton(q, k, v, a, b, A_log, dt_bias, plain_pool, slots, qsl, init,
                                       block_v=16 if H == HV else None)
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert torch.equal(got, plain) and torch.equal(got_pool.nan_to_num(0.0), plain_pool.nan_to_num(0.0))
    _assert_pools(got_pool, want_pool)
    _assert_pools(got_snaps, want_snaps)
    assert not got_snaps[:13].isnan().any() and got_snaps[13].isnan().all()


# ---- the causal conv1d ---------------------------------------------------------------------------------------------

@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", [4, 2])
def test_conv_prefill_matches_reference(dtype, K):
    """Chunks of 70, 1, 0, 2 and 5 tokens (the 1- and 2-token chunks shorter than the window: their new windows
    keep old rows; the empty one leaves its slot alone), C = 40 channels over 16-token x 128-channel tiles that
    straddle sequences."""
    lens, C = [70, 1, 0, 2, 5], 40
    qsl = _qsl(lens)
    slots = torch.tensor([3, 0, 5, 2, 1], dtype=torch.int32, device=DEVICE)
    init = torch.tensor([True, True, False, True, False], device=DEVICE)
    x = _rows(sum(lens), C, dtype)
    w = torch.randn(C, 1, K, device=DEVICE).to(dtype).squeeze(1)  # the layer's conv1d.weight [C, 1, K]
    pool = _slot_pool((K - 1, C), dtype, init, slots)
    want_pool, got_pool = pool.clone(), pool.clone()
    want = causal_conv1d_ref(x, w, want_pool, slots, qsl, init)
    got = causal_conv1d_triton(x, w, got_pool, slots, qsl, init)
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert torch.equal(got_pool.isnan(), want_pool.isnan())
    assert torch.equal(got_pool.nan_to_num(0.0), want_pool.nan_to_num(0.0))  # windows are copies of inputs
    assert torch.isnan(got_pool[5]).all()  # the empty chunk's slot (no initial state) untouched


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_saves_match_reference_and_prefixes(dtype):
    """Windows after the saved token rows: the kernel's equal the reference's bit for bit (copies of inputs), and
    each is the window the reference writes back when run on the prefix alone (from the old window at a chunk's
    first tokens, zeros where the sequence starts at position 0); the conv's output and slot windows are unchanged."""
    C, K = 40, 4
    qsl = _qsl(SAVE_LENS)
    slots = torch.tensor([3, 0, 5, 2], dtype=torch.int32, device=DEVICE)
    init = torch.tensor(SAVE_INIT, device=DEVICE)
    x = _rows(sum(SAVE_LENS), C, dtype)
    w = torch.randn(C, K, device=DEVICE).to(dtype)
    pool = _slot_pool((K - 1, C), dtype, init, slots)
    snaps = torch.full((NUM_SNAPSHOTS, K - 1, C), float("nan"), device=DEVICE).to(dtype)
    saves = _saves(SAVE_TRIPLES, SAVE_LENS)
    want_pool, got_pool, plain_pool = pool.clone(), pool.clone(), pool.clone()
    want_snaps, got_snaps = snaps.clone(), snaps.clone()
    want = causal_conv1d_ref(x, w, want_pool, slots, qsl, init, want_snaps, saves)
    got = causal_conv1d_triton(x, w, got_pool, slots, qsl, init, got_snaps, saves)
    plain = causal_conv1d_triton(x, w, plain_pool, slots, qsl, init)
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert torch.equal(got, plain) and torch.equal(got_pool.nan_to_num(0.0), plain_pool.nan_to_num(0.0))
    assert torch.equal(got_snaps.isnan(), want_snaps.isnan())
    assert torch.equal(got_snaps.nan_to_num(0.0), want_snaps.nan_to_num(0.0))
    for i, t, sid in SAVE_TRIPLES:
        s = int(qsl[i])
        one = pool[slots[i].long()].clone().unsqueeze(0)
        causal_conv1d_ref(x[s:s + t + 1], w, one, torch.zeros(1, dtype=torch.int32, device=DEVICE), _qsl([t + 1]),
                          init[i:i + 1])
        assert torch.equal(want_snaps[sid], one[0])


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_update_matches_reference(dtype):
    C, K = 300, 4  # two 256-channel tiles, the second partial
    slots = torch.tensor([3, 0, 5], dtype=torch.int32, device=DEVICE)
    init = torch.tensor([True, False, True], device=DEVICE)
    x = _rows(3, C, dtype)
    w = torch.randn(C, K, device=DEVICE).to(dtype)
    pool = _slot_pool((K - 1, C), dtype, init, slots)
    want_pool, got_pool = pool.clone(), pool.clone()
    want = causal_conv1d_update_ref(x, w, want_pool, slots, init)
    got = causal_conv1d_update_triton(x, w, got_pool, slots, init)
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert torch.equal(got_pool.isnan(), want_pool.isnan())
    assert torch.equal(got_pool.nan_to_num(0.0), want_pool.nan_to_num(0.0))
    assert torch.equal(got_pool[slots.long(), -1], x)  # the new token is the window's last row


# ---- the gated RMSNorm ---------------------------------------------------------------------------------------------

@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_rms_norm_matches_reference(dtype):
    """o [T, HV, dv] with z a strided view of the projection (token stride wider than HV * dv), dv = 24 (a partial
    block); a 2-D input too."""
    T, HV, dv = 11, 3, 24
    x = torch.randn(T, HV, dv, device=DEVICE).to(dtype)
    z = _rows(T, HV * dv, dtype).view(T, HV, dv)
    w = (1 + 0.3 * torch.randn(dv, device=DEVICE)).to(dtype)
    assert not z.is_contiguous()
    for xx, zz in ((x, z), (x[:, 1], z[:, 1])):
        got, want = gated_rms_norm_triton(xx, zz, w, 1e-6), gated_rms_norm_ref(xx, zz, w, 1e-6)
        assert got.shape == xx.shape and got.dtype == dtype
        torch.testing.assert_close(got, want, **TOL[dtype])
