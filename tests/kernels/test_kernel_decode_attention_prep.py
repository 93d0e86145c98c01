"""Decode attention with the q/k-norm + RoPE + KV store folded in (one split launch + the reduce) vs the
unfused references: qkv_prep_ref, then paged_decode_attention_ref. Both the output and the cache the
fused kernel leaves behind are compared."""

from __future__ import annotations

import pytest
import torch

from gyrfalcon.kernels.fused_qkv_prep import qkv_prep_triton
from gyrfalcon.kernels.decode_attention import (decode_attention_with_prep_ref,
                                                decode_attention_with_prep_triton,
                                                paged_decode_attention_triton)
from kernels_testutil import ATTN_TOL, DEVICE, requires_triton

# Contexts after this step's token: partly filled blocks, a first token, CUDA-graph padding rows
# (seq_len 0, slot -1), a context that spans several splits.
SEQ_LENS = [5, 0, 1, 33, 16, 47]


def _case(seq_lens, H, KVH, D, rot, dtype, norm, block_size=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    B = len(seq_lens)
    blocks_per_seq = max(1, -(-max(seq_lens) // block_size))
    nb = B * blocks_per_seq + 3
    perm = torch.randperm(nb, generator=g)
    bt = torch.full((B, blocks_per_seq + 2), 10**8, dtype=torch.int32)  # unused entries: never read
    for i, s in enumerate(seq_lens):
        n = -(-s // block_size)
        bt[i, :n] = perm[i * blocks_per_seq: i * blocks_per_seq + n].to(torch.int32)
    kc = torch.randn(nb, block_size, KVH, D, generator=g).to(dtype)
    vc = torch.randn(nb, block_size, KVH, D, generator=g).to(dtype)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    pos = (sl.long() - 1).clamp(min=0)
    slots = torch.tensor([int(bt[i, (s - 1) // block_size]) * block_size + (s - 1) % block_size if s else -1
                          for i, s in enumerate(seq_lens)])
    qkv = torch.randn(B, (H + 2 * KVH) * D, generator=g).to(dtype)
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    freqs = torch.outer(torch.arange(max(64, max(seq_lens))).float(), inv)
    cs = torch.cat([freqs.cos(), freqs.sin()], -1)
    qw = (1 + 0.3 * torch.randn(D, generator=g)).to(dtype) if norm else None
    kw = (1 + 0.3 * torch.randn(D, generator=g)).to(dtype) if norm else None
    to = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    return [to(t) for t in (qkv, pos, cs, slots, kc, vc, bt, sl, qw, kw)]


@requires_triton
@pytest.mark.parametrize("H,KVH,D,rot", [(4, 2, 32, 32), (6, 2, 16, 8), (2, 2, 64, 64)])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("prefetch", [False, True], ids=["plain", "prefetch"])
def test_fused_matches_unfused_refs(H, KVH, D, rot, is_neox, norm, dtype, num_splits, prefetch):
    """prefetch: the first K/V tile is loaded before the qkv row and the new token's (stale) slot is
    patched from registers; with 1 split the 47-token row's new token sits in its third tile (the loop's
    patch), with 4 splits in its last split's only tile (the prefetched tile's patch)."""
    qkv, pos, cs, slots, kc, vc, bt, sl, qw, kw = _case(SEQ_LENS, H, KVH, D, rot, dtype, norm)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    want = decode_attention_with_prep_ref(qkv, H, KVH, D, pos, cs, rot, is_neox, kc_ref, vc_ref, slots, bt, sl,
                                          D ** -0.5, None, qw, kw, 1e-6)
    got = decode_attention_with_prep_triton(qkv, H, KVH, D, pos, cs, rot, is_neox, kc, vc, slots, bt, sl,
                                            D ** -0.5, num_splits, qw, kw, 1e-6, block_n=16, min_part=16,
                                            prefetch=prefetch)
    assert got.shape == (len(SEQ_LENS), H, D)
    torch.testing.assert_close(got, want, **ATTN_TOL[dtype])
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(kc, kc_ref, **tol)  # the new tokens' rotated keys, nothing else touched
    torch.testing.assert_close(vc, vc_ref, rtol=0, atol=0)
    assert torch.count_nonzero(got[1]) == 0  # padding row


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("prefetch", [False, True], ids=["plain", "prefetch"])
@pytest.mark.parametrize("norm", [True, False])
def test_row_scale_matches_the_reference(dtype, num_splits, prefetch, norm):
    """Folded input norm (row_scale = (x, eps)): q, the new K and V scaled by each sequence's rstd(x) first, in
    every path (plain, prefetched tile, several splits); padding rows (seq_len 0) stay zero."""
    H, KVH, D, rot = 4, 2, 32, 32
    qkv, pos, cs, slots, kc, vc, bt, sl, qw, kw = _case(SEQ_LENS, H, KVH, D, rot, dtype, norm)
    x = (torch.randn(len(SEQ_LENS), 300, generator=torch.Generator().manual_seed(7)) * 2).to(dtype).to(DEVICE)
    rs = (x, 1e-5)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    want = decode_attention_with_prep_ref(qkv, H, KVH, D, pos, cs, rot, True, kc_ref, vc_ref, slots, bt, sl,
                                          D ** -0.5, None, qw, kw, 1e-6, row_scale=rs)
    got = decode_attention_with_prep_triton(qkv, H, KVH, D, pos, cs, rot, True, kc, vc, slots, bt, sl,
                                            D ** -0.5, num_splits, qw, kw, 1e-6, row_scale=rs, block_n=16,
                                            min_part=16, prefetch=prefetch)
    torch.testing.assert_close(got, want, **ATTN_TOL[dtype])
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(kc, kc_ref, **tol)
    torch.testing.assert_close(vc, vc_ref, **tol)
    assert torch.count_nonzero(got[1]) == 0  # padding row
    # and the scale matters: without it the output differs
    kc2, vc2 = kc_ref.clone(), vc_ref.clone()
    plain = decode_attention_with_prep_ref(qkv, H, KVH, D, pos, cs, rot, True, kc2, vc2, slots, bt, sl,
                                           D ** -0.5, None, qw, kw, 1e-6)
    assert not torch.allclose(plain, want, **ATTN_TOL[dtype])


@requires_triton
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("prefetch", [False, True], ids=["plain", "prefetch"])
@pytest.mark.parametrize("k_rows", [False, True])
def test_fused_equals_the_two_triton_launches(num_splits, prefetch, k_rows):
    """Same arithmetic as fused_qkv_prep's kernel followed by the plain split launch: equal outputs
    (up to the order of one reduction) and bitwise-equal caches; k_rows: key tiles in row layout."""
    H, KVH, D = 4, 2, 32
    qkv, pos, cs, slots, kc, vc, bt, sl, qw, kw = _case(SEQ_LENS, H, KVH, D, D, torch.bfloat16, True, seed=3)
    kc2, vc2 = kc.clone(), vc.clone()
    got = decode_attention_with_prep_triton(qkv, H, KVH, D, pos, cs, D, True, kc, vc, slots, bt, sl, 0.2,
                                            num_splits, qw, kw, 1e-6, block_n=16, min_part=16, prefetch=prefetch,
                                            key_rows=k_rows and not prefetch)
    q = qkv_prep_triton(qkv, H, KVH, D, pos, cs, D, True, kc2, vc2, slots, qw, kw, 1e-6)
    want = paged_decode_attention_triton(q, kc2, vc2, bt, sl, 0.2, num_splits, block_n=16, min_part=16,
                                         key_rows=k_rows)
    torch.testing.assert_close(kc, kc2, rtol=0, atol=0)
    torch.testing.assert_close(vc, vc2, rtol=0, atol=0)
    torch.testing.assert_close(got, want, **ATTN_TOL[torch.bfloat16])


@pytest.mark.parametrize("pdl", [True, False])
def test_prefetch_default_follows_pdl(pdl):
    from gyrfalcon.kernels.decode_attention import prefetch_default
    assert prefetch_default(pdl) is pdl


@requires_triton
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("prefetch", [False, True], ids=["plain", "prefetch"])
def test_fp8_cache_attends_over_what_it_stored(num_splits, prefetch):
    """kv_cache_dtype fp8: the fused launch stores the new token as float8 e4m3 and attends over the fp8
    cache, the new token included (patched from registers under prefetch): its output equals plain decode
    attention over the cache it left behind. (The stored values themselves are checked on the GPU,
    tests/gpu: the Triton interpreter rounds some values to fp8 wrongly, e.g. 1.96 to 1.0 where the
    hardware and torch give 2.0.)"""
    from gyrfalcon.kernels.decode_attention import paged_decode_attention_ref
    H, KVH, D = 4, 2, 32
    qkv, pos, cs, slots, kc, vc, bt, sl, qw, kw = _case(SEQ_LENS, H, KVH, D, D, torch.float32, True, seed=5)
    kc8, vc8 = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    before = kc8.view(torch.uint8).clone()
    got = decode_attention_with_prep_triton(qkv, H, KVH, D, pos, cs, D, True, kc8, vc8, slots, bt, sl, 0.2,
                                            num_splits, qw, kw, 1e-6, block_n=16, min_part=16, prefetch=prefetch)
    q = qkv_prep_triton(qkv, H, KVH, D, pos, cs, D, True, kc.clone(), vc.clone(), slots, qw, kw, 1e-6)
    want = paged_decode_attention_ref(q, kc8, vc8, bt, sl, 0.2)
    torch.testing.assert_close(got, want, **ATTN_TOL[torch.float32])
    changed = (kc8.view(torch.uint8) != before).flatten(2).any(-1).nonzero().tolist()  # [block, offset]
    stored = {(int(s) // 4, int(s) % 4) for s in slots if s >= 0}
    assert changed and {(b, o) for b, o in changed} <= stored  # only the new tokens' slots were written


@requires_triton
@pytest.mark.parametrize("num_splits,want_bn", [(None, 64), (1, 128)], ids=["split", "one-split"])
def test_batch1_prefetch_default_tile(num_splits, want_bn, monkeypatch):
    """The batch-1 prefetching launch at its default shape (no block_n given): B1_SPLIT_TILE-key tiles where it
    splits the context (each split's one tile prefetched), 128-key tiles for the short graphs' one split; both
    match the reference, a 200-token context spanning several 64-key tiles (and two 128-key ones)."""
    import sys

    from kernels_testutil import LaunchSpy
    pda = sys.modules[paged_decode_attention_triton.__module__]  # the package re-exports a same-named function
    spy = LaunchSpy(pda._decode_prep_kernel, "BLOCK_N")
    monkeypatch.setattr(pda, "_decode_prep_kernel", spy)
    H, KVH, D = 4, 2, 32
    qkv, pos, cs, slots, kc, vc, bt, sl, qw, kw = _case([200], H, KVH, D, D, torch.float32, True, block_size=16)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    want = decode_attention_with_prep_ref(qkv, H, KVH, D, pos, cs, D, True, kc_ref, vc_ref, slots, bt, sl,
                                          D ** -0.5, None, qw, kw, 1e-6)
    got = decode_attention_with_prep_triton(qkv, H, KVH, D, pos, cs, D, True, kc, vc, slots, bt, sl, D ** -0.5,
                                            num_splits, qw, kw, 1e-6, prefetch=True)
    assert spy.seen == [want_bn]
    torch.testing.assert_close(got, want, **ATTN_TOL[torch.float32])
    torch.testing.assert_close(kc, kc_ref, rtol=1e-5, atol=1e-5)


@requires_triton
@pytest.mark.parametrize("wide_env", [None, "small-card"], ids=["wide-tile", "small-card"])
def test_batch16_wide_tile(wide_env, monkeypatch):
    """Batch 16 at 8 kv heads (128 programs) with the fused prep on a bf16 cache in one split (the one-split
    graphs): by default one stage of 256-key tiles at 8 warps (WIDE_TILE_CONFIG); 128-key tiles on an fp32 cache,
    or on a card with less shared memory a program than the tile needs (sm_89's
    99 KB: max_shared_mem stubbed); 64-key tiles over 4 splits of >= 256 keys (the main graphs' launch:
    MID_TILE_CONFIG). Contexts below, across and past a 256-key tile: the output and the cache match the
    references."""
    import sys

    from kernels_testutil import LaunchSpy
    pda = sys.modules[paged_decode_attention_triton.__module__]
    if wide_env == "small-card":
        monkeypatch.setattr(sys.modules["gyrfalcon.kernels.decode_attention.configs"], "max_shared_mem",
                            lambda device: 99 * 1024)
    spy = LaunchSpy(pda._decode_prep_kernel, "BLOCK_N")
    monkeypatch.setattr(pda, "_decode_prep_kernel", spy)
    lens = [1, 300, 0, 129, 256, 257, 17, 200, 64, 5, 600, 128, 33, 2, 513, 160]
    H, KVH, D = 16, 8, 32
    cases = [(torch.bfloat16, 1, 256 if wide_env is None else 128)]
    if wide_env is None:  # the launches the card does not touch, once
        cases += [(torch.bfloat16, 4, 64), (torch.float32, 1, 128)]
    for dtype, splits, want_bn in cases:
        qkv, pos, cs, slots, kc, vc, bt, sl, qw, kw = _case(lens, H, KVH, D, D, dtype, True, block_size=16)
        kc_ref, vc_ref = kc.clone(), vc.clone()
        want = decode_attention_with_prep_ref(qkv, H, KVH, D, pos, cs, D, True, kc_ref, vc_ref, slots, bt, sl,
                                              D ** -0.5, None, qw, kw, 1e-6)
        got = decode_attention_with_prep_triton(qkv, H, KVH, D, pos, cs, D, True, kc, vc, slots, bt, sl, D ** -0.5,
                                                splits, qw, kw, 1e-6, pdl=False, prefetch=False)
        assert spy.seen[-1] == want_bn
        torch.testing.assert_close(got, want, **ATTN_TOL[dtype])
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(kc, kc_ref, **tol)
        torch.testing.assert_close(vc, vc_ref, rtol=0, atol=0)
        assert torch.count_nonzero(got[2]) == 0  # padding row
