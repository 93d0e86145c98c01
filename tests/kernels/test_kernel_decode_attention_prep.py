"""Decode attention with the q/k-norm + RoPE + KV store folded in (one split launch + the reduce) vs the
unfused references: qkv_prep_ref, then paged_decode_attention_ref. Both the output and the cache the
fused kernel leaves behind are compared."""

from __future__ import annotations

import pytest
import torch

from gyrfalcon.kernels.fused_qkv_prep import qkv_prep_triton
from gyrfalcon.kernels.paged_decode_attention import (decode_attention_with_prep_ref,
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
@pytest.mark.parametrize("prefetch,early", [(False, False), (True, False), (False, True)],
                         ids=["plain", "prefetch", "early-loads"])
def test_fused_matches_unfused_refs(H, KVH, D, rot, is_neox, norm, dtype, num_splits, prefetch, early):
    """prefetch: the first K/V tile is loaded before the qkv row and the new token's (stale) slot is
    patched from registers; with 1 split the 47-token row's new token sits in its third tile (the loop's
    patch), with 4 splits in its last split's only tile (the prefetched tile's patch). early-loads: the prep's
    loads issued beside seq_len's, ahead of the empty-split exit (GYRFALCON_DECODE_EARLY_LOADS)."""
    qkv, pos, cs, slots, kc, vc, bt, sl, qw, kw = _case(SEQ_LENS, H, KVH, D, rot, dtype, norm)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    want = decode_attention_with_prep_ref(qkv, H, KVH, D, pos, cs, rot, is_neox, kc_ref, vc_ref, slots, bt, sl,
                                          D ** -0.5, None, qw, kw, 1e-6)
    got = decode_attention_with_prep_triton(qkv, H, KVH, D, pos, cs, rot, is_neox, kc, vc, slots, bt, sl,
                                            D ** -0.5, num_splits, qw, kw, 1e-6, block_n=16, min_part=16,
                                            prefetch=prefetch, early_loads=early)
    assert got.shape == (len(SEQ_LENS), H, D)
    torch.testing.assert_close(got, want, **ATTN_TOL[dtype])
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(kc, kc_ref, **tol)  # the new tokens' rotated keys, nothing else touched
    torch.testing.assert_close(vc, vc_ref, rtol=0, atol=0)
    assert torch.count_nonzero(got[1]) == 0  # padding row


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("prefetch,early", [(False, False), (True, False), (False, True)],
                         ids=["plain", "prefetch", "early-loads"])
@pytest.mark.parametrize("norm", [True, False])
def test_row_scale_matches_the_reference(dtype, num_splits, prefetch, early, norm):
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
                                            min_part=16, prefetch=prefetch, early_loads=early)
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
@pytest.mark.parametrize("prefetch,early", [(False, False), (True, False), (False, True)],
                         ids=["plain", "prefetch", "early-loads"])
@pytest.mark.parametrize("k_rows", ["0", "1"])
def test_fused_equals_the_two_triton_launches(num_splits, prefetch, early, k_rows, monkeypatch):
    """Same arithmetic as fused_qkv_prep's kernel followed by the plain split launch: equal outputs
    (up to the order of one reduction) and bitwise-equal caches; k_rows: GYRFALCON_DECODE_K_ROWS."""
    monkeypatch.setenv("GYRFALCON_DECODE_K_ROWS", k_rows)
    H, KVH, D = 4, 2, 32
    qkv, pos, cs, slots, kc, vc, bt, sl, qw, kw = _case(SEQ_LENS, H, KVH, D, D, torch.bfloat16, True, seed=3)
    kc2, vc2 = kc.clone(), vc.clone()
    got = decode_attention_with_prep_triton(qkv, H, KVH, D, pos, cs, D, True, kc, vc, slots, bt, sl, 0.2,
                                            num_splits, qw, kw, 1e-6, block_n=16, min_part=16, prefetch=prefetch,
                                            early_loads=early)
    q = qkv_prep_triton(qkv, H, KVH, D, pos, cs, D, True, kc2, vc2, slots, qw, kw, 1e-6)
    want = paged_decode_attention_triton(q, kc2, vc2, bt, sl, 0.2, num_splits, block_n=16, min_part=16)
    torch.testing.assert_close(kc, kc2, rtol=0, atol=0)
    torch.testing.assert_close(vc, vc2, rtol=0, atol=0)
    torch.testing.assert_close(got, want, **ATTN_TOL[torch.bfloat16])


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq_len,num_splits", [(47, 4), (47, 1), (3, 4), (0, 4)])
@pytest.mark.parametrize("peel", [False, True])
def test_o_proj_merging_the_split_partials(dtype, seq_len, num_splits, peel):
    """Batch 1: decode attention stops at its per-split partials and o_proj merges them while loading its
    input (no reduce launch): equal to attention's output through a linear layer."""
    from gyrfalcon.kernels.paged_decode_attention import merge_partials_ref
    from gyrfalcon.kernels.small_m_gemv import GemvConfig, merged_heads_gemv_ref, merged_heads_gemv_triton

    H, KVH, D, hidden = 4, 2, 32, 48
    qkv, pos, cs, slots, kc, vc, bt, sl, qw, kw = _case([seq_len], H, KVH, D, D, dtype, True, seed=5)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    want_o = decode_attention_with_prep_ref(qkv, H, KVH, D, pos, cs, D, True, kc_ref, vc_ref, slots, bt, sl,
                                            D ** -0.5, None, qw, kw, 1e-6)
    parts = decode_attention_with_prep_triton(qkv, H, KVH, D, pos, cs, D, True, kc, vc, slots, bt, sl, D ** -0.5,
                                              num_splits, qw, kw, 1e-6, block_n=16, min_part=16, partials=True)
    torch.testing.assert_close(kc, kc_ref, **(dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32
                                              else dict(rtol=2e-2, atol=2e-2)))
    o = merge_partials_ref(parts)
    assert o.shape == (1, H * D) and o.dtype == dtype
    torch.testing.assert_close(o.view(1, H, D), want_o, **ATTN_TOL[dtype])
    w = (torch.randn(hidden, H * D, generator=torch.Generator().manual_seed(1)) / (H * D) ** 0.5).to(dtype)
    w = w.to(DEVICE)
    # Two K tiles of 64 inputs (two heads each), as the GPU's 1024-wide tiles hold eight heads.
    got = merged_heads_gemv_triton(parts, w, config=GemvConfig(8, 64, 4, 1), peel=peel)
    ref = merged_heads_gemv_ref(parts, w)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, ref, **tol)
    torch.testing.assert_close(got.float(), (want_o.reshape(1, -1).float() @ w.float().t()), **ATTN_TOL[dtype])
    if seq_len == 0:
        assert torch.count_nonzero(got) == 0
    # The default launch shape (input tiles sized to the split count).
    torch.testing.assert_close(merged_heads_gemv_triton(parts, w, peel=peel), ref, **tol)
    # One tile over the whole row (the merged batch-1 graph's shape under PDL: no loop after the peel).
    got = merged_heads_gemv_triton(parts, w, config=GemvConfig(8, H * D, 4, 1), peel=peel)
    torch.testing.assert_close(got, ref, **tol)


@pytest.mark.parametrize("splits,pdl,want_k", [(2, True, 2048), (4, True, 2048), (16, True, 512),
                                               (2, False, 1024), (4, False, 1024)])
def test_merged_o_proj_takes_the_whole_row_under_pdl(splits, pdl, want_k):
    """Qwen3-0.6B's o_proj (1024 x 2048): with PDL and 2-4 splits one input tile spans the row (the weight
    slice loads before the wait, the merge runs once); 16 splits' partials cap the tile; without PDL the
    plain 1024-input tiles."""
    from gyrfalcon.kernels.small_m_gemv import MERGED_TILE_ELEMS, merged_config

    cfg = merged_config(1024, 2048, splits, 2, pdl)
    assert cfg.block_k == want_k and cfg.block_k * splits <= MERGED_TILE_ELEMS


@pytest.mark.parametrize("env,pdl,want", [(None, True, True), (None, False, False), ("pdl", True, True),
                                          ("1", False, True), ("1", True, True), ("0", True, False)])
def test_prefetch_default_follows_pdl_and_the_switch(monkeypatch, env, pdl, want):
    from gyrfalcon.kernels.paged_decode_attention import prefetch_default
    if env is None:
        monkeypatch.delenv("GYRFALCON_ATTN_PREFETCH", raising=False)
    else:
        monkeypatch.setenv("GYRFALCON_ATTN_PREFETCH", env)
    assert prefetch_default(pdl) is want


def test_early_loads_switch(monkeypatch):
    """EARLY_LOADS is off unless GYRFALCON_DECODE_EARLY_LOADS=1 (it tied whole steps on the H200, run 68)."""
    from gyrfalcon.kernels.paged_decode_attention import early_loads_default
    monkeypatch.delenv("GYRFALCON_DECODE_EARLY_LOADS", raising=False)
    assert not early_loads_default()
    monkeypatch.setenv("GYRFALCON_DECODE_EARLY_LOADS", "1")
    assert early_loads_default()


@requires_triton
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("prefetch,early", [(False, False), (True, False), (False, True)],
                         ids=["plain", "prefetch", "early-loads"])
def test_fp8_cache_attends_over_what_it_stored(num_splits, prefetch, early):
    """kv_cache_dtype fp8: the fused launch stores the new token as float8 e4m3 and attends over the fp8
    cache, the new token included (patched from registers under prefetch): its output equals plain decode
    attention over the cache it left behind. (The stored values themselves are checked on the GPU,
    tests/gpu: the Triton interpreter rounds some values to fp8 wrongly, e.g. 1.96 to 1.0 where the
    hardware and torch give 2.0.)"""
    from gyrfalcon.kernels.paged_decode_attention import paged_decode_attention_ref
    H, KVH, D = 4, 2, 32
    qkv, pos, cs, slots, kc, vc, bt, sl, qw, kw = _case(SEQ_LENS, H, KVH, D, D, torch.float32, True, seed=5)
    kc8, vc8 = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    before = kc8.view(torch.uint8).clone()
    got = decode_attention_with_prep_triton(qkv, H, KVH, D, pos, cs, D, True, kc8, vc8, slots, bt, sl, 0.2,
                                            num_splits, qw, kw, 1e-6, block_n=16, min_part=16, prefetch=prefetch,
                                            early_loads=early)
    q = qkv_prep_triton(qkv, H, KVH, D, pos, cs, D, True, kc.clone(), vc.clone(), slots, qw, kw, 1e-6)
    want = paged_decode_attention_ref(q, kc8, vc8, bt, sl, 0.2)
    torch.testing.assert_close(got, want, **ATTN_TOL[torch.float32])
    changed = (kc8.view(torch.uint8) != before).flatten(2).any(-1).nonzero().tolist()  # [block, offset]
    stored = {(int(s) // 4, int(s) % 4) for s in slots if s >= 0}
    assert changed and {(b, o) for b, o in changed} <= stored  # only the new tokens' slots were written


@requires_triton
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("prefetch,early", [(False, False), (True, False), (False, True)],
                         ids=["plain", "prefetch", "early-loads"])
def test_fused_with_a_column_major_block_table(num_splits, prefetch, early):
    """The decode graphs' column-major block table (runner/cuda_graph.DecodeInputs), the prefetched tile
    included: the same output and cache writes as with the row-major table."""
    qkv, pos, cs, slots, kc, vc, bt, sl, qw, kw = _case(SEQ_LENS, 4, 2, 32, 32, torch.float32, True)
    kc2, vc2 = kc.clone(), vc.clone()
    n, w = bt.shape
    buf = torch.full((w + 4, n + 2), 10**6, dtype=bt.dtype, device=bt.device)
    buf[:w, :n] = bt.t()
    bt_cols = buf.t()[:n]
    args = dict(num_splits=num_splits, block_n=16, min_part=16, prefetch=prefetch, early_loads=early)
    want = decode_attention_with_prep_triton(qkv, 4, 2, 32, pos, cs, 32, True, kc, vc, slots, bt, sl, 32 ** -0.5,
                                             q_norm_weight=qw, k_norm_weight=kw, **args)
    got = decode_attention_with_prep_triton(qkv, 4, 2, 32, pos, cs, 32, True, kc2, vc2, slots, bt_cols, sl,
                                            32 ** -0.5, q_norm_weight=qw, k_norm_weight=kw, **args)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(kc2, kc) and torch.equal(vc2, vc)


@requires_triton
@pytest.mark.parametrize("num_splits,want_bn", [(None, 64), (1, 128)], ids=["split", "one-split"])
def test_batch1_prefetch_default_tile(num_splits, want_bn, monkeypatch):
    """The batch-1 prefetching launch at its default shape (no block_n given): B1_SPLIT_TILE-key tiles where it
    splits the context (each split's one tile prefetched), 128-key tiles for the short graphs' one split; both
    match the reference, a 200-token context spanning several 64-key tiles (and two 128-key ones)."""
    import sys

    from kernels_testutil import LaunchSpy
    pda = sys.modules[paged_decode_attention_triton.__module__]  # the package re-exports a same-named function
    monkeypatch.delenv("GYRFALCON_DECODE_ATTN_CONFIG", raising=False)
    spy = LaunchSpy(pda._decode_split_kernel, "BLOCK_N")
    monkeypatch.setattr(pda, "_decode_split_kernel", spy)
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
@pytest.mark.parametrize("wide_env", [None, "0", "small-card"], ids=["wide-tile", "off", "small-card"])
def test_batch16_wide_tile(wide_env, monkeypatch):
    """Batch 16 at 8 kv heads (128 programs) with the fused prep on a bf16 cache in one split (the one-split
    graphs): by default one stage of 256-key tiles at 8 warps (WIDE_TILE_CONFIG); 128-key tiles on an fp32 cache,
    with GYRFALCON_DECODE_WIDE_TILE=0 or on a card with less shared memory a program than the tile needs (sm_89's
    99 KB: max_shared_mem stubbed); 64-key tiles over 4 splits of >= 256 keys (the main graphs' launch:
    MID_TILE_CONFIG). Contexts below, across and past a 256-key tile: the output and the cache match the
    references."""
    import sys

    from kernels_testutil import LaunchSpy
    pda = sys.modules[paged_decode_attention_triton.__module__]
    monkeypatch.delenv("GYRFALCON_DECODE_ATTN_CONFIG", raising=False)
    monkeypatch.delenv("GYRFALCON_DECODE_MIN_PART", raising=False)
    monkeypatch.delenv("GYRFALCON_DECODE_MID_TILE", raising=False)
    if wide_env == "0":
        monkeypatch.setenv("GYRFALCON_DECODE_WIDE_TILE", wide_env)
    else:
        monkeypatch.delenv("GYRFALCON_DECODE_WIDE_TILE", raising=False)
    if wide_env == "small-card":
        monkeypatch.setattr(pda, "max_shared_mem", lambda device: 99 * 1024)
    spy = LaunchSpy(pda._decode_split_kernel, "BLOCK_N")
    monkeypatch.setattr(pda, "_decode_split_kernel", spy)
    lens = [1, 300, 0, 129, 256, 257, 17, 200, 64, 5, 600, 128, 33, 2, 513, 160]
    H, KVH, D = 16, 8, 32
    cases = [(torch.bfloat16, 1, 256 if wide_env is None else 128)]
    if wide_env is None:  # the launches the switch and the card do not touch, once
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
