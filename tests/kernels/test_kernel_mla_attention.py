"""Paged MLA attention (kernels/mla_attention): the reference against the expanded form of MLA (per-head keys and
values rebuilt from the latent, float64), the cache write, and the Triton split-K kernel (decode rows; prefill
steps as one row per query token) against the reference, on ragged batches with partly filled, shuffled blocks."""

import pytest
import torch

from gyrfalcon.kernels.mla_attention import (merge_partials, mla_attention, mla_attention_ref, mla_decode_ref,
                                             mla_decode_triton, mla_prefill_expanded_ref, mla_prefill_expanded_triton,
                                             mla_prefill_tiled_triton, mla_prefill_triton, store_latent,
                                             store_latent_ref)
from kernels_testutil import ATTN_TOL, DEVICE, requires_triton

# Ragged: a fresh prefill, chunks over a cached prefix, decode rows, an empty query, a context of many blocks.
RAGGED = ([7, 3, 1, 0, 12, 1], [7, 11, 9, 4, 12, 53])


def _cache(seq_lens, width, block_size, dtype, extra_blocks=3):
    """Random rows per sequence scattered into shuffled blocks -> (cache [NB, bs, 1, width], block_tables int32,
    dense rows per sequence [S, width]). Slots past a sequence's end hold NaN: they must never be read."""
    n_blocks = [-(-s // block_size) for s in seq_lens]
    total = sum(n_blocks) + extra_blocks
    cache = torch.full((total, block_size, 1, width), float("nan"), device=DEVICE).to(dtype)
    perm = torch.randperm(total).tolist()
    bt = torch.zeros(len(seq_lens), max(1, max(n_blocks)), dtype=torch.int32)
    dense = []
    for i, s in enumerate(seq_lens):
        ids = [perm.pop() for _ in range(n_blocks[i])]
        bt[i, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
        rows = torch.randn(s, width, device=DEVICE).to(dtype)
        for j in range(s):
            cache[ids[j // block_size], j % block_size, 0] = rows[j]
        dense.append(rows)
    return cache, bt.to(DEVICE), dense


def _qsl(q_lens):
    return torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)


def _expanded_attention(q_nope, q_rope, rows, w_uk, w_uv, L, scale):
    """MLA as the model defines it, float64: keys [k_nope_h | k_rope], values v_h, per head from the latent.
    q_nope [q, H, nope], q_rope [q, H, R] at the LAST q positions of rows [S, L + R]; w_uk [H, nope, L],
    w_uv [H, v, L] -> [q, H, v]."""
    rows = rows.double()
    latent, k_rope = rows[:, :L], rows[:, L:]
    k_nope = torch.einsum("hnl,sl->shn", w_uk.double(), latent)
    v = torch.einsum("hvl,sl->shv", w_uv.double(), latent)
    scores = (torch.einsum("qhn,shn->hqs", q_nope.double(), k_nope)
              + torch.einsum("qhr,sr->hqs", q_rope.double(), k_rope)) * scale
    S, q_len = rows.shape[0], q_nope.shape[0]
    causal = torch.arange(S)[None, :] > torch.arange(S - q_len, S)[:, None]
    probs = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
    return torch.einsum("hqs,shv->qhv", probs, v)


@pytest.mark.parametrize("block_size", [4, 16])
def test_ref_absorbed_equals_expanded_mla(block_size):
    """The absorbed form ([q_nope W_UK | q_rope] against the latent rows, W_UV after) is MLA's attention."""
    H, nope, R, L, V = 4, 16, 8, 32, 12
    q_lens, seq_lens = RAGGED
    cache, bt, dense = _cache(seq_lens, L + R, block_size, torch.float32)
    T = sum(q_lens)
    dev = cache.device  # the helpers build the cache where the kernels run (a GPU when there is one)
    q_nope, q_rope = torch.randn(T, H, nope, device=dev), torch.randn(T, H, R, device=dev)
    w_uk, w_uv = torch.randn(H, nope, L, device=dev) / L ** 0.5, torch.randn(H, V, L, device=dev) / L ** 0.5
    q_abs = torch.cat([torch.einsum("thn,hnl->thl", q_nope, w_uk), q_rope], dim=-1)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    o_lat = mla_attention_ref(q_abs, cache, bt, sl, _qsl(q_lens), 0.3, L)
    assert o_lat.shape == (T, H, L)
    o = torch.einsum("thl,hvl->thv", o_lat, w_uv)
    qsl = _qsl(q_lens).tolist()
    for i, ql in enumerate(q_lens):
        s, e = qsl[i], qsl[i + 1]
        if ql:
            want = _expanded_attention(q_nope[s:e], q_rope[s:e], dense[i], w_uk, w_uv, L, 0.3)
            torch.testing.assert_close(o[s:e].double(), want, atol=1e-5, rtol=1e-5)


def test_ref_query_chunking(monkeypatch):
    """Chunking long queries to bound the score memory changes nothing."""
    import sys

    naive = sys.modules["gyrfalcon.kernels.mla_attention.naive"]
    cache, bt, _ = _cache([13], 24, 4, torch.float32)
    q = torch.randn(9, 4, 24)
    args = (q, cache, bt, torch.tensor([13], dtype=torch.int32), _qsl([9]), 0.25, 16)
    full = naive.mla_attention_ref(*args)
    monkeypatch.setattr(naive, "_REF_SCORE_BYTES", 4 * 4 * 13 * 2)  # 2 queries per chunk
    torch.testing.assert_close(naive.mla_attention_ref(*args), full)


def test_store_latent_ref():
    L, R, bs = 16, 8, 4
    cache = torch.zeros(5, bs, 1, L + R)
    latent, k_rope = torch.randn(4, L), torch.randn(4, R)
    slots = torch.tensor([9, -1, 0, 19])  # a padding row (-1) writes nothing
    store_latent_ref(latent, k_rope, cache, slots)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            torch.testing.assert_close(cache[slot // bs, slot % bs, 0], torch.cat([latent[t], k_rope[t]]))
    assert int((cache.abs().sum(-1) > 0).sum()) == 3


@requires_triton
def test_store_latent_dispatch_matches_ref():
    """store_latent writes through store_kv on the cache's two column ranges (the Triton kernel on CUDA or under
    the interpreter when called directly); same cache as the reference."""
    from gyrfalcon.kernels.store_kv import store_kv_triton

    L, R, bs = 16, 8, 4
    latent, k_rope = torch.randn(6, L, device=DEVICE), torch.randn(6, R, device=DEVICE)
    slots = torch.tensor([3, 17, -1, 4, 0, 11], device=DEVICE)
    want = torch.zeros(6, bs, 1, L + R, device=DEVICE)
    store_latent_ref(latent, k_rope, want, slots)
    got = torch.zeros_like(want)
    store_kv_triton(latent.unsqueeze(1), k_rope.unsqueeze(1), got[..., :L], got[..., L:], slots)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    got2 = torch.zeros_like(want)
    store_latent(latent, k_rope, got2, slots)
    torch.testing.assert_close(got2, want, rtol=0, atol=0)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("L,R,H", [(16, 8, 4), (64, 16, 20)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_decode_matches_ref(dtype, L, R, H, num_splits):
    """Split-K decode: one query per sequence over partly filled blocks; contexts shorter than the splits
    (empty splits), a padding row (seq_len 0: zeros), head counts off the head block (20 of 16 + 16)."""
    seq_lens = [1, 5, 0, 37, 16]
    cache, bt, _ = _cache(seq_lens, L + R, 4, dtype)
    q = torch.randn(len(seq_lens), H, L + R, device=DEVICE).to(dtype)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    want = mla_decode_ref(q, cache, bt, sl, 0.2, L)
    got = mla_decode_triton(q, cache, bt, sl, 0.2, L, num_splits, block_n=16)
    assert got.shape == want.shape == (len(seq_lens), H, L)
    assert torch.equal(got[2], torch.zeros_like(got[2]))
    torch.testing.assert_close(got.float(), want.float(), **ATTN_TOL[dtype])


@requires_triton
def test_triton_decode_default_splits():
    """The launch's own split choice (from the block-table width) gives the reference's output."""
    seq_lens = [70, 3]
    cache, bt, _ = _cache(seq_lens, 24, 8, torch.float32)
    q = torch.randn(2, 4, 24, device=DEVICE)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    torch.testing.assert_close(mla_decode_triton(q, cache, bt, sl, 0.3, 16), mla_decode_ref(q, cache, bt, sl, 0.3, 16),
                               **ATTN_TOL[torch.float32])


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_prefill_matches_ref(dtype):
    """Non-decode steps: every query token a row of the split-K kernel, its context ending at its position; a
    ragged batch (fresh prefill, chunks over a cached prefix, decode rows, an empty query), then padding as a
    mixed graph leaves it: 3 tokens past query_start_loc[-1] and 2 empty sequences (zeros for the padding)."""
    L, R, H = 16, 8, 4
    q_lens, seq_lens = RAGGED
    cache, bt, _ = _cache(seq_lens, L + R, 4, dtype)
    T = sum(q_lens)
    q = torch.randn(T + 3, H, L + R, device=DEVICE).to(dtype)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    want = mla_attention_ref(q[:T], cache, bt, sl, _qsl(q_lens), 0.2, L)
    for splits in (None, 2):
        got = mla_prefill_triton(q[:T], cache, bt, sl, _qsl(q_lens), 0.2, L, splits, block_n=16)
        torch.testing.assert_close(got.float(), want.float(), **ATTN_TOL[dtype])
    pad_bt = torch.cat([bt, torch.zeros(2, bt.shape[1], dtype=bt.dtype, device=DEVICE)])
    pad_sl = torch.cat([sl, torch.zeros(2, dtype=sl.dtype, device=DEVICE)])
    got = mla_prefill_triton(q, cache, pad_bt, pad_sl, _qsl(q_lens + [0, 0]), 0.2, L)
    torch.testing.assert_close(got[:T].float(), want.float(), **ATTN_TOL[dtype])
    assert torch.equal(got[T:], torch.zeros_like(got[T:]))


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tiles", [dict(block_q=4, block_h=4), dict(block_q=2, block_h=8), dict()],
                         ids=["4tok_x_4heads", "2tok_x_8heads", "default"])
def test_triton_tiled_prefill_matches_ref(dtype, tiles):
    """The tiled prefill (query tokens x heads per program sharing each key tile): the ragged batch (a fresh prefill
    and chunks spanning several query tiles, decode rows, an empty query, a long context), 6 heads (off the head
    block), 16-key tiles over 4-slot blocks; then a mixed graph's padding: 3 tokens past query_start_loc[-1] and 2
    empty sequences get zeros."""
    L, R, H = 16, 8, 6
    q_lens, seq_lens = RAGGED
    cache, bt, _ = _cache(seq_lens, L + R, 4, dtype)
    T = sum(q_lens)
    q = torch.randn(T + 3, H, L + R, device=DEVICE).to(dtype)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    want = mla_attention_ref(q[:T], cache, bt, sl, _qsl(q_lens), 0.2, L)
    got = mla_prefill_tiled_triton(q[:T], cache, bt, sl, _qsl(q_lens), 0.2, L, block_n=16, **tiles)
    torch.testing.assert_close(got.float(), want.float(), **ATTN_TOL[dtype])
    pad_bt = torch.cat([bt, torch.zeros(2, bt.shape[1], dtype=bt.dtype, device=DEVICE)])
    pad_sl = torch.cat([sl, torch.zeros(2, dtype=sl.dtype, device=DEVICE)])
    got = mla_prefill_tiled_triton(q, cache, pad_bt, pad_sl, _qsl(q_lens + [0, 0]), 0.2, L, **tiles)
    torch.testing.assert_close(got[:T].float(), want.float(), **ATTN_TOL[dtype])
    assert torch.equal(got[T:], torch.zeros_like(got[T:]))


def test_dispatch_uses_reference_off_cuda():
    """CPU tensors take the reference (the CPU path), decode or not."""
    cache, bt, _ = _cache([5, 9], 24, 4, torch.float32)
    q = torch.randn(2, 4, 24)
    sl = torch.tensor([5, 9], dtype=torch.int32)
    want = mla_decode_ref(q, cache, bt, sl, 0.3, 16)
    torch.testing.assert_close(mla_attention(q.cpu(), cache.cpu(), bt.cpu(), sl, _qsl([1, 1]).cpu(), 0.3, 16,
                                             is_decode=True), want.cpu())


# The expanded form (kernels/mla_attention/expanded.py). Ragged sequences as (q_len, prefix): a fresh prefill, a
# chunk over a cached prefix (keys past the tile's queries), an empty query, a single query over a long prefix, and
# lengths off the 16-row tiles.
EXPANDED = [(7, 0), (5, 11), (0, 4), (1, 20), (19, 3)]


def _expanded_inputs(seqs, H, nope, R, V, dtype, L=24):
    """Latent rows per sequence expanded by a random kv_b_proj, packed contiguously: (q_nope [T, H, nope],
    q_rope [T, H, R], k_nope [N, H, nope] and v [N, H, V] as strided views of one [N, H, nope + V] projection
    (the layer's layout), k_rope [N, R], cu_q, per-sequence (latent rows, k_rope rows), w_uk, w_uv)."""
    T = sum(q for q, _ in seqs)
    q_nope = torch.randn(T, H, nope, device=DEVICE).to(dtype)
    q_rope = torch.randn(T, H, R, device=DEVICE).to(dtype)
    rows = [torch.randn(q + p, L + R, device=DEVICE) for q, p in seqs]
    w_uk, w_uv = torch.randn(H, nope, L, device=DEVICE) / L ** 0.5, torch.randn(H, V, L, device=DEVICE) / L ** 0.5
    allrows = torch.cat(rows)
    kv = torch.einsum("nl,hdl->nhd", allrows[:, :L], torch.cat([w_uk, w_uv], dim=1)).to(dtype)
    return (q_nope, q_rope, kv[..., :nope], allrows[:, L:].to(dtype), kv[..., nope:], _qsl([q for q, _ in seqs]),
            rows, w_uk, w_uv, L)


def _whole_meta(seqs):
    """meta [B, 3] for every sequence's whole context in one call: keys from its row 0, delta = its prefix."""
    meta, start = [], 0
    for q, p in seqs:
        meta.append([start, q + p, p])
        start += q + p
    return torch.tensor(meta, dtype=torch.int32, device=DEVICE)


def test_ref_expanded_equals_mla():
    """The expanded reference is MLA's attention (float64 oracle from the latent rows), with the same output as
    the absorbed form; lse is the row's log2-sum-exp of the scaled scores."""
    H, nope, R, V = 4, 16, 8, 12
    q_nope, q_rope, k_nope, k_rope, v, cu_q, rows, w_uk, w_uv, L = _expanded_inputs(EXPANDED, H, nope, R, V,
                                                                                     torch.float32)
    o, lse = mla_prefill_expanded_ref(q_nope, q_rope, k_nope, k_rope, v, cu_q, _whole_meta(EXPANDED), 0.3)
    qs = cu_q.tolist()
    for i, (ql, _) in enumerate(EXPANDED):
        s, e = qs[i], qs[i + 1]
        if ql:
            want = _expanded_attention(q_nope[s:e], q_rope[s:e], rows[i], w_uk, w_uv, L, 0.3)
            torch.testing.assert_close(o[s:e].double(), want, atol=1e-5, rtol=1e-5)
    # The last query of the fresh prefill sees all of its 7 keys.
    k = torch.einsum("hnl,sl->shn", w_uk, rows[0][:, :L])
    scores = (torch.einsum("hn,shn->hs", q_nope[6], k) + q_rope[6] @ rows[0][:, L:].T) * 0.3
    torch.testing.assert_close(lse[6], torch.logsumexp(scores, -1) * 1.4426950408889634, atol=1e-5, rtol=1e-5)


def test_ref_expanded_chunks_merge():
    """A context split into key chunks (one call each: the later chunk hides keys from the early queries, the
    first one leaves the fresh prefill's first row alone with its only key) merges exactly into one call's
    output."""
    H, nope, R, V = 3, 16, 8, 8
    q_nope, q_rope, k_nope, k_rope, v, cu_q, *_ = _expanded_inputs(EXPANDED, H, nope, R, V, torch.float32)
    whole, whole_lse = mla_prefill_expanded_ref(q_nope, q_rope, k_nope, k_rope, v, cu_q, _whole_meta(EXPANDED), 0.3)
    o, lse, split = None, None, 6  # keys [0, 6) of each sequence, then the rest
    for lo in (0, split):
        meta, start = [], 0
        for q, p in EXPANDED:
            n = q + p
            a, b = min(lo, n), (min(split, n) if lo == 0 else n)
            meta.append([start + a, b - a, p - a])
            start += n
        part = mla_prefill_expanded_ref(q_nope, q_rope, k_nope, k_rope, v, cu_q,
                                        torch.tensor(meta, dtype=torch.int32, device=DEVICE), 0.3)
        o, lse = part if o is None else merge_partials(o, lse, *part)
    torch.testing.assert_close(o, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, whole_lse, atol=1e-5, rtol=1e-5)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tiles", [dict(block_m=16, block_n=16), dict()], ids=["16x16", "default"])
@pytest.mark.parametrize("dims", [(24, 8, 12), (16, 16, 16)], ids=["odd_dims", "pow2_dims"])
def test_triton_expanded_matches_ref(dtype, tiles, dims):
    """The Triton expanded prefill against its reference: the ragged batch with prefixes (strided K_nope / V views
    of one projection; head dims (nope, rope, v) off the power of two, and powers of two: the unmasked full-tile
    loads; 16-key tiles put whole tiles below the causal bound), then a later key chunk (negative delta: early
    queries see nothing, lse -inf and zeros) and 3 padding tokens past cu_q[-1] left zero."""
    H, (nope, R, V) = 3, dims
    q_nope, q_rope, k_nope, k_rope, v, cu_q, *_ = _expanded_inputs(EXPANDED, H, nope, R, V, dtype)
    meta = _whole_meta(EXPANDED)
    want, want_lse = mla_prefill_expanded_ref(q_nope, q_rope, k_nope, k_rope, v, cu_q, meta, 0.3)
    got, got_lse = mla_prefill_expanded_triton(q_nope, q_rope, k_nope, k_rope, v, cu_q, meta, 0.3, **tiles)
    torch.testing.assert_close(got.float(), want.float(), **ATTN_TOL[dtype])
    torch.testing.assert_close(got_lse, want_lse, **ATTN_TOL[dtype])
    late = meta.clone()
    late[:, 0] += 6
    late[:, 1] = (late[:, 1] - 6).clamp(min=0)
    late[:, 2] -= 6
    pad = lambda t: torch.cat([t, torch.zeros(3, *t.shape[1:], dtype=t.dtype, device=DEVICE)])  # noqa: E731
    want, want_lse = mla_prefill_expanded_ref(q_nope, q_rope, k_nope, k_rope, v, cu_q, late, 0.3)
    assert bool((want_lse == float("-inf")).any())
    got, got_lse = mla_prefill_expanded_triton(pad(q_nope), pad(q_rope), k_nope, k_rope, v, cu_q, late, 0.3,
                                               torch.float32, **tiles)
    torch.testing.assert_close(got[:-3], want.float(), **ATTN_TOL[dtype])
    torch.testing.assert_close(got_lse[:-3], want_lse, **ATTN_TOL[dtype])
    assert torch.equal(got[-3:], torch.zeros_like(got[-3:])) and bool((got_lse[-3:] == float("-inf")).all())
