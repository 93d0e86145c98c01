import pytest
import torch

from gyrfalcon.kernels.paged_attention import paged_attention_ref, paged_attention_triton
from kernels_testutil import ATTN_TOL, DEVICE, DTYPES, make_paged_kv, naive_causal_attention, requires_triton


def _batch(q_lens, seq_lens, n_heads, n_kv, head_dim, block_size, dtype, head_dim_v=None, fill=0):
    k_cache, v_cache, bt, dk, dv = make_paged_kv(seq_lens, n_kv, head_dim, block_size, dtype,
                                                 head_dim_v=head_dim_v, fill=fill)
    q = torch.randn(sum(q_lens), n_heads, head_dim, device=DEVICE).to(dtype)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, bt, sl, qsl, dk, dv


# Ragged: fresh prefill (q_len == seq_len), chunked prefill over a cached prefix, decode (q_len 1),
# blocks partly filled, an empty sequence (q_len 0) in the middle, and a long cached prefix whose
# key tiles lie wholly below the causal diagonal (the kernel's unmasked phase).
RAGGED = ([7, 3, 1, 0, 12, 6], [7, 11, 9, 4, 12, 53])


@pytest.mark.parametrize("n_heads,n_kv", [(2, 2), (4, 2), (4, 1)])
def test_ref_matches_dense_attention(n_heads, n_kv):
    q_lens, seq_lens = RAGGED
    q, kc, vc, bt, sl, qsl, dk, dv = _batch(q_lens, seq_lens, n_heads, n_kv, 16, 4, torch.float32)
    out = paged_attention_ref(q, kc, vc, bt, sl, qsl, 0.3)
    for i, ql in enumerate(q_lens):
        s, e = qsl[i].item(), qsl[i + 1].item()
        if ql:
            want = naive_causal_attention(q[s:e], dk[i], dv[i], 0.3)
            torch.testing.assert_close(out[s:e].double(), want, atol=1e-5, rtol=1e-5)


def test_ref_query_chunking(monkeypatch):
    # Chunking queries to bound memory must not change the result.
    import sys

    pa = sys.modules["gyrfalcon.kernels.paged_attention.naive"]

    q, kc, vc, bt, sl, qsl, _, _ = _batch([9], [13], 4, 2, 16, 4, torch.float32)
    full = pa.paged_attention_ref(q, kc, vc, bt, sl, qsl, 0.25)
    monkeypatch.setattr(pa, "_REF_SCORE_BYTES", 4 * 4 * 13 * 2)  # 2 queries per chunk
    torch.testing.assert_close(pa.paged_attention_ref(q, kc, vc, bt, sl, qsl, 0.25), full)


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_heads,n_kv", [(2, 2), (4, 2), (8, 2)])
def test_triton_matches_ref_ragged(dtype, n_heads, n_kv):
    q_lens, seq_lens = RAGGED
    q, kc, vc, bt, sl, qsl, _, _ = _batch(q_lens, seq_lens, n_heads, n_kv, 32, 4, dtype)
    want = paged_attention_ref(q, kc, vc, bt, sl, qsl, 0.2)
    # Small tiles: several query and key tiles per sequence, tiles straddling cache blocks.
    got = paged_attention_triton(q, kc, vc, bt, sl, qsl, 0.2, block_m=16, block_n=16)
    torch.testing.assert_close(got, want, **ATTN_TOL[dtype])


@requires_triton
@pytest.mark.parametrize("head_dim,block_size", [(16, 16), (64, 8), (128, 16), (256, 4), (80, 8)])
def test_triton_head_dims(head_dim, block_size):
    dtype = torch.bfloat16
    q_lens, seq_lens = [5, 1, 3], [5, 20, 150]
    q, kc, vc, bt, sl, qsl, _, _ = _batch(q_lens, seq_lens, 4, 2, head_dim, block_size, dtype)
    want = paged_attention_ref(q, kc, vc, bt, sl, qsl, head_dim ** -0.5)
    got = paged_attention_triton(q, kc, vc, bt, sl, qsl, head_dim ** -0.5, max_query_len=5, max_seq_len=150)
    torch.testing.assert_close(got, want, **ATTN_TOL[dtype])


def test_prefill_tiles_by_query_length():
    from gyrfalcon.kernels.paged_attention import SHORT_QUERY, prefill_config

    short, long_ = prefill_config(128, 4, SHORT_QUERY), prefill_config(128, 4, SHORT_QUERY + 1)
    assert short != long_ and short[1] < long_[1]  # short queries: fewer keys per tile
    assert prefill_config(128, 4, None) == long_  # nothing known: the long-prompt tiles


@requires_triton
@pytest.mark.parametrize("max_query_len", [None, 7, 4096], ids=["bound_by_tokens", "short", "long_tiles"])
def test_triton_head_dim_128_short_and_long_tiles(max_query_len):
    # Both tile choices of head_dim 128 on the same ragged batch (a max_query_len above the real one is a
    # valid bound, so 4096 forces the long-prompt tiles on it).
    q_lens, seq_lens = [7, 1, 3], [40, 70, 3]
    q, kc, vc, bt, sl, qsl, _, _ = _batch(q_lens, seq_lens, 8, 2, 128, 16, torch.bfloat16)
    want = paged_attention_ref(q, kc, vc, bt, sl, qsl, 128 ** -0.5)
    got = paged_attention_triton(q, kc, vc, bt, sl, qsl, 128 ** -0.5, max_query_len=max_query_len)
    torch.testing.assert_close(got, want, **ATTN_TOL[torch.bfloat16])


@requires_triton
def test_triton_default_tiles_non_pow2_group_and_v_dim():
    # 6 query heads per kv head (not a power of two) and a V head dim different from K's.
    q_lens, seq_lens = [20, 2], [20, 37]
    q, kc, vc, bt, sl, qsl, _, _ = _batch(q_lens, seq_lens, 12, 2, 32, 8, torch.float32, head_dim_v=24)
    want = paged_attention_ref(q, kc, vc, bt, sl, qsl, 0.2)
    got = paged_attention_triton(q, kc, vc, bt, sl, qsl, 0.2)
    assert got.shape == (22, 12, 24)
    torch.testing.assert_close(got, want, **ATTN_TOL[torch.float32])


@requires_triton
def test_triton_garbage_unused_block_table_entries():
    # Unused block-table entries must never be dereferenced: fill them with a huge block id.
    q_lens, seq_lens = [3, 1], [6, 2]
    q, kc, vc, bt, sl, qsl, _, _ = _batch(q_lens, seq_lens, 2, 1, 16, 4, torch.float32, fill=10**8)
    want = paged_attention_ref(q, kc, vc, bt, sl, qsl, 0.5)
    got = paged_attention_triton(q, kc, vc, bt, sl, qsl, 0.5, block_m=16, block_n=16)
    torch.testing.assert_close(got, want, **ATTN_TOL[torch.float32])


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_fp8_cache_matches_ref(dtype):
    """kv_cache_dtype fp8: prefill / chunked prefill read float8 e4m3 key / value tiles, widened to fp32 beside
    an fp32 query and to fp16 beside a 16-bit one (the query rounded to fp16 as well; the interpreter then
    upcasts the operands); the reference reads the same fp8 values with the bf16 query."""
    q_lens, seq_lens = RAGGED
    q, kc, vc, bt, sl, qsl, _, _ = _batch(q_lens, seq_lens, 4, 2, 32, 8, torch.float32, fill=10**8)
    kc8, vc8, q = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn), q.to(dtype)
    want = paged_attention_ref(q, kc8, vc8, bt, sl, qsl, 0.25)
    got = paged_attention_triton(q, kc8, vc8, bt, sl, qsl, 0.25)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, **ATTN_TOL[dtype])
