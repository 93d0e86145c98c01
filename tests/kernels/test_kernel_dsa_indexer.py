"""DeepSeek sparse attention kernels: the lightning indexer (kernels/dsa_indexer: key-cache write, scores before
top-k, top-k) against plain float64 math and its Triton score kernel against the reference; sparse MLA
(kernels/mla_attention with `indices`) against masked expanded attention, and its split-K kernel (decode rows,
per-token prefill rows) against the reference. Ragged batches over partly filled, shuffled blocks."""

import pytest
import torch

from gyrfalcon.kernels.dsa_indexer import (indexer_scores, indexer_scores_ref, indexer_scores_triton, indexer_topk,
                                           indexer_topk_ref, indexer_topk_triton, select_topk, store_index_keys,
                                           store_index_keys_ref)
from gyrfalcon.kernels.mla_attention import (mla_attention_ref, mla_decode_ref, mla_decode_triton,
                                             mla_prefill_triton)
from kernels_testutil import ATTN_TOL, DEVICE, requires_triton
from test_kernel_mla_attention import RAGGED, _cache, _qsl


def _plain_scores(q, w, keys, q_pos0):
    """float64: score[t, j] = sum_h w[t, h] relu(q[t, h] . keys[j]) for j <= q_pos0 + t, else -inf."""
    s = torch.einsum("th,ths->ts", w.double(), torch.relu(torch.einsum("thd,sd->ths", q.double(), keys.double())))
    q_pos = q_pos0 + torch.arange(q.shape[0])[:, None]
    return s.masked_fill(torch.arange(keys.shape[0])[None, :] > q_pos, float("-inf"))


def _inputs(q_lens, seq_lens, H, D, dtype=torch.float32, block_size=4):
    cache, bt, dense = _cache(seq_lens, D, block_size, dtype)
    T = sum(q_lens)
    q = torch.randn(T, H, D, device=DEVICE).to(dtype)
    w = torch.randn(T, H, device=DEVICE)  # fp32: the layer's weights_proj output, scales folded in
    return q, w, cache, bt, dense, torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), _qsl(q_lens)


def test_ref_scores_are_the_indexer_formula():
    """Per sequence, the reference's [T, W] scores are sum_h w_h relu(q_h . k_j) over the causal keys, -inf past each
    query's position and past the context (W = block table width x block size)."""
    q_lens, seq_lens = RAGGED
    q, w, cache, bt, dense, sl, qsl = _inputs(q_lens, seq_lens, 4, 16)
    got = indexer_scores_ref(q, w, cache, bt, sl, qsl)
    assert got.shape == (sum(q_lens), bt.shape[1] * 4) and got.dtype == torch.float32
    bounds = qsl.tolist()
    for i, (ql, s) in enumerate(zip(q_lens, seq_lens)):
        if not ql:
            continue
        rows = got[bounds[i]:bounds[i + 1]]
        want = _plain_scores(q[bounds[i]:bounds[i + 1]].cpu(), w[bounds[i]:bounds[i + 1]].cpu(), dense[i].cpu(), s - ql)
        torch.testing.assert_close(rows[:, :s].double().cpu(), want, rtol=1e-5, atol=1e-5)
        assert torch.isneginf(rows[:, s:]).all()


def test_ref_topk_selects_the_best_causal_keys(monkeypatch):
    """index_topk of the causal keys per query (all of them while fewer; equal scores: the lower positions), -1 in
    the columns left over; chunking the queries to bound memory changes nothing."""
    import sys

    naive = sys.modules["gyrfalcon.kernels.dsa_indexer.naive"]
    q_lens, seq_lens = RAGGED
    q, w, cache, bt, dense, sl, qsl = _inputs(q_lens, seq_lens, 4, 16)
    k = 6
    got = indexer_topk_ref(q, w, cache, bt, sl, qsl, k)
    assert got.shape == (sum(q_lens), k) and got.dtype == torch.int32
    bounds = qsl.tolist()
    for i, (ql, s) in enumerate(zip(q_lens, seq_lens)):
        if not ql:
            continue
        want_scores = _plain_scores(q[bounds[i]:bounds[i + 1]].cpu(), w[bounds[i]:bounds[i + 1]].cpu(),
                                    dense[i].cpu(), s - ql)
        for r in range(ql):
            p = s - ql + r
            n = min(k, p + 1)
            row = got[bounds[i] + r].tolist()
            # Ties (exact zeros after the relu) go to the lower position.
            best = sorted(range(p + 1), key=lambda j: (-want_scores[r, j].item(), j))[:n]
            assert sorted(row[:n]) == sorted(best), (i, r)
            assert row[n:] == [-1] * (k - n)
    monkeypatch.setattr(naive, "_REF_SCORE_BYTES", 4 * 4 * 53 * 3)  # 3 queries per chunk for the longest sequence
    assert torch.equal(indexer_topk_ref(q, w, cache, bt, sl, qsl, k), got)


def test_select_topk_breaks_ties_by_position_whatever_the_row_width(monkeypatch):
    """Equal scores (the relu's exact zeros, -0.0 among them) go to the lower position, so a row's selection is the
    same with -inf columns after it (a verify step's or the Triton path's layout) or beside other rows, in row
    chunks too; the order is by score, then position."""
    import sys

    naive = sys.modules["gyrfalcon.kernels.dsa_indexer.naive"]
    g = torch.Generator().manual_seed(3)
    S, k = 37, 8
    rows = torch.randn(16, S, generator=g).relu() * (torch.rand(16, S, generator=g) < 0.3)  # ~80 % exact zeros
    rows[0, ::2] = -0.0
    rows[1] = 0.5  # every key tied
    rows[2, 5:] = float("-inf")  # 5 candidates for 8 columns
    want = []
    for r in rows:
        order = sorted(range(S), key=lambda j: (-r[j].item(), j))[:k]
        want.append([j if r[j] > float("-inf") else -1 for j in order])
    want = torch.tensor(want, dtype=torch.int32)
    assert torch.equal(select_topk(rows, k), want)
    assert torch.equal(select_topk(rows.to(DEVICE), k).cpu(), want)
    padded = torch.cat([rows, torch.full((16, 91), float("-inf"))], dim=-1)
    assert torch.equal(select_topk(padded, k), want)
    for i in range(16):
        assert torch.equal(select_topk(rows[i:i + 1], k), want[i:i + 1])
    monkeypatch.setattr(naive, "_TOPK_KEY_BYTES", 8 * S * 3)  # 3 rows per chunk
    assert torch.equal(select_topk(rows, k), want)
    assert torch.equal(select_topk(rows[:2, :3], 5), torch.tensor([[0, 1, 2, -1, -1], [0, 1, 2, -1, -1]],
                                                                   dtype=torch.int32))


def test_store_index_keys():
    """The reference write, and the dispatching one (store_kv over the row's two halves): the same cache, slot -1
    skipped."""
    bs, D = 4, 16
    k = torch.randn(5, D, device=DEVICE)
    slots = torch.tensor([9, -1, 0, 19, 3], device=DEVICE)
    want = torch.zeros(6, bs, 1, D, device=DEVICE)
    store_index_keys_ref(k, want, slots)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            torch.testing.assert_close(want[slot // bs, slot % bs, 0], k[t])
    assert int((want.abs().sum(-1) > 0).sum()) == 4
    got = torch.zeros_like(want)
    store_index_keys(k, got, slots)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@requires_triton
def test_store_index_keys_triton_matches_ref():
    from gyrfalcon.kernels.store_kv import store_kv_triton

    k = torch.randn(5, 16, device=DEVICE)
    slots = torch.tensor([9, -1, 0, 19, 3], device=DEVICE)
    want = torch.zeros(6, 4, 1, 16, device=DEVICE)
    store_index_keys_ref(k, want, slots)
    got = torch.zeros_like(want)
    store_kv_triton(k[:, None, :8], k[:, None, 8:], got[..., :8], got[..., 8:], slots)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,D,block_n", [(4, 16, 16), (20, 32, 64), (64, 128, 32)])
def test_triton_scores_match_ref(dtype, H, D, block_n):
    """The score kernel: ragged batch (fresh prefill, chunks over a cached prefix, decode rows, an empty query, a
    context of many blocks), head counts off the head block (20 = 16 + 4), tiles past every context; then padding
    as a graph leaves it (tokens past query_start_loc[-1], empty sequences): -inf rows."""
    q_lens, seq_lens = RAGGED
    q, w, cache, bt, _, sl, qsl = _inputs(q_lens, seq_lens, H, D, dtype)
    want = indexer_scores_ref(q, w, cache, bt, sl, qsl)
    got = indexer_scores_triton(q, w, cache, bt, sl, qsl, block_n=block_n)
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got))
    # Sums over H heads of D-long dots in another order: fp32 rounding grows with H and D.
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2 * D ** 0.5)
    torch.testing.assert_close(got[finite], want[finite], **tol)
    T = q.shape[0]
    q_pad = torch.cat([q, torch.randn(3, H, D, device=DEVICE).to(dtype)])
    w_pad = torch.cat([w, torch.randn(3, H, device=DEVICE)])
    pad_bt = torch.cat([bt, torch.zeros(2, bt.shape[1], dtype=bt.dtype, device=DEVICE)])
    pad_sl = torch.cat([sl, torch.zeros(2, dtype=sl.dtype, device=DEVICE)])
    got = indexer_scores_triton(q_pad, w_pad, cache, pad_bt, pad_sl, _qsl(q_lens + [0, 0]), block_n=block_n)
    assert torch.equal(torch.isfinite(got[:T]), finite) and torch.isneginf(got[T:]).all()
    torch.testing.assert_close(got[:T][finite], want[finite], **tol)


@requires_triton
@pytest.mark.parametrize("k", [1, 6, 64])
def test_triton_topk_matches_ref(k):
    """Scores + torch.topk on them: the reference's sets (continuous random scores: no ties), -1 where a query has
    fewer candidates; k = 64 is wider than most contexts here."""
    q_lens, seq_lens = RAGGED
    q, w, cache, bt, _, sl, qsl = _inputs(q_lens, seq_lens, 8, 16)
    want = indexer_topk_ref(q, w, cache, bt, sl, qsl, k)
    got = indexer_topk_triton(q, w, cache, bt, sl, qsl, k)
    assert got.shape == want.shape == (sum(q_lens), k)
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)


def test_dispatch_uses_reference_off_cuda():
    q_lens, seq_lens = [3, 1], [3, 9]
    cache, bt, _ = _cache(seq_lens, 16, 4, torch.float32)
    q, w = torch.randn(4, 4, 16), torch.randn(4, 4)
    args = (q, w, cache.cpu(), bt.cpu(), torch.tensor(seq_lens, dtype=torch.int32), _qsl(q_lens).cpu())
    assert torch.equal(indexer_scores(*args), indexer_scores_ref(*args))
    assert torch.equal(indexer_topk(*args, 2), indexer_topk_ref(*args, 2))


def _random_indices(q_lens, seq_lens, k, g):
    """Per query token, k entries: a random subset of its causal keys (fewer when it has fewer), -1 and positions
    past the context (which must select nothing) in the rest."""
    rows = []
    for ql, s in zip(q_lens, seq_lens):
        for r in range(ql):
            p = s - ql + r
            n = min(k - 1, p + 1)
            pick = torch.randperm(p + 1, generator=g)[:n].tolist()
            rows.append(pick + [-1] * (k - 1 - n) + [s + 5])
    return torch.tensor(rows, dtype=torch.int32, device=DEVICE).view(-1, k)


def test_sparse_ref_is_masked_attention():
    """mla_attention_ref with indices: the softmax over the selected causal keys only (float64 masked attention);
    with every causal key listed it is dense MLA."""
    L, R, H = 16, 8, 4
    q_lens, seq_lens = RAGGED
    cache, bt, dense = _cache(seq_lens, L + R, 4, torch.float32)
    q = torch.randn(sum(q_lens), H, L + R, device=DEVICE)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    idx = _random_indices(q_lens, seq_lens, 5, torch.Generator().manual_seed(0))
    got = mla_attention_ref(q, cache, bt, sl, _qsl(q_lens), 0.3, L, idx)
    bounds = _qsl(q_lens).tolist()
    for i, (ql, s) in enumerate(zip(q_lens, seq_lens)):
        for r in range(ql):
            t = bounds[i] + r
            keys = [j for j in idx[t].tolist() if 0 <= j < s]
            rows = dense[i][keys].double()
            p = torch.softmax(torch.einsum("hd,kd->hk", q[t].double(), rows) * 0.3, dim=-1)
            torch.testing.assert_close(got[t].double(), p @ rows[:, :L], rtol=1e-5, atol=1e-5)
    every = torch.tensor([list(range(s - ql + r + 1)) + [-1] * (60 - (s - ql + r + 1))
                          for ql, s in zip(q_lens, seq_lens) for r in range(ql)], dtype=torch.int32, device=DEVICE)
    torch.testing.assert_close(mla_attention_ref(q, cache, bt, sl, _qsl(q_lens), 0.3, L, every),
                               mla_attention_ref(q, cache, bt, sl, _qsl(q_lens), 0.3, L))


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_sparse_decode_matches_ref(dtype, num_splits):
    """Split-K decode reading each row's index list: splits over the list (some empty), -1 and out-of-context
    entries skipped, a padding row (seq_len 0: zeros)."""
    L, R, H = 16, 8, 20
    seq_lens = [1, 5, 0, 37, 16]
    cache, bt, _ = _cache(seq_lens, L + R, 4, dtype)
    q = torch.randn(len(seq_lens), H, L + R, device=DEVICE).to(dtype)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    idx = _random_indices([1] * 4, [s for s in seq_lens if s], 24,
                          torch.Generator().manual_seed(1))
    idx = torch.cat([idx[:2], torch.full((1, 24), 3, dtype=torch.int32, device=DEVICE), idx[2:]])  # the padding row
    want = mla_decode_ref(q, cache, bt, sl, 0.2, L, indices=idx)
    got = mla_decode_triton(q, cache, bt, sl, 0.2, L, num_splits, indices=idx, block_n=16)
    assert torch.equal(got[2], torch.zeros_like(got[2]))
    torch.testing.assert_close(got.float(), want.float(), **ATTN_TOL[dtype])
    # The selection is honoured: the dense kernel gives something else on the long row.
    dense = mla_decode_triton(q, cache, bt, sl, 0.2, L, num_splits, block_n=16)
    assert (dense[3].float() - want[3].float()).abs().max() > 1e-2


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_sparse_prefill_matches_ref(dtype):
    """Non-decode steps: each query token's row of indices with its own causal context; then graph padding
    (tokens past query_start_loc[-1], empty sequences): zeros."""
    L, R, H = 16, 8, 4
    q_lens, seq_lens = RAGGED
    cache, bt, _ = _cache(seq_lens, L + R, 4, dtype)
    T = sum(q_lens)
    q = torch.randn(T + 3, H, L + R, device=DEVICE).to(dtype)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    idx = _random_indices(q_lens, seq_lens, 7, torch.Generator().manual_seed(2))
    want = mla_attention_ref(q[:T], cache, bt, sl, _qsl(q_lens), 0.2, L, idx)
    for splits in (None, 2):
        got = mla_prefill_triton(q[:T], cache, bt, sl, _qsl(q_lens), 0.2, L, splits, indices=idx, block_n=16)
        torch.testing.assert_close(got.float(), want.float(), **ATTN_TOL[dtype])
    pad_bt = torch.cat([bt, torch.zeros(2, bt.shape[1], dtype=bt.dtype, device=DEVICE)])
    pad_sl = torch.cat([sl, torch.zeros(2, dtype=sl.dtype, device=DEVICE)])
    pad_idx = torch.cat([idx, torch.zeros(3, 7, dtype=idx.dtype, device=DEVICE)])
    got = mla_prefill_triton(q, cache, pad_bt, pad_sl, _qsl(q_lens + [0, 0]), 0.2, L, indices=pad_idx)
    torch.testing.assert_close(got[:T].float(), want.float(), **ATTN_TOL[dtype])
    assert torch.equal(got[T:], torch.zeros_like(got[T:]))
