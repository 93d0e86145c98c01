import pytest
import torch

from gyrfalcon.kernels.paged_attention import paged_attention_ref
from gyrfalcon.kernels.paged_decode_attention import (
    MAX_SPLITS,
    default_num_splits,
    paged_decode_attention_ref,
    paged_decode_attention_triton,
)
from kernels_testutil import (ATTN_TOL, DEVICE, DTYPES, LaunchSpy, make_paged_kv, naive_causal_attention,
                              requires_triton)

# Contexts: partly filled blocks, a single token, CUDA-graph padding rows (seq_len 0), a longer one.
SEQ_LENS = [5, 0, 1, 33, 16, 0]


def _batch(seq_lens, n_heads, n_kv, head_dim, block_size, dtype, fill=0, head_dim_v=None):
    kc, vc, bt, dk, dv = make_paged_kv(seq_lens, n_kv, head_dim, block_size, dtype, fill=fill,
                                       head_dim_v=head_dim_v)
    q = torch.randn(len(seq_lens), n_heads, head_dim, device=DEVICE).to(dtype)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return q, kc, vc, bt, sl, dk, dv


@pytest.mark.parametrize("n_heads,n_kv", [(2, 2), (4, 1), (8, 2)])
def test_ref_matches_dense_attention(n_heads, n_kv):
    q, kc, vc, bt, sl, dk, dv = _batch(SEQ_LENS, n_heads, n_kv, 16, 4, torch.float32, fill=10**6)
    out = paged_decode_attention_ref(q, kc, vc, bt, sl, 0.3)
    for i, s in enumerate(SEQ_LENS):
        if s == 0:
            assert torch.count_nonzero(out[i]) == 0
        else:
            want = naive_causal_attention(q[i : i + 1], dk[i], dv[i], 0.3)[0]
            torch.testing.assert_close(out[i].double(), want, atol=1e-5, rtol=1e-5)


def test_ref_matches_paged_attention_ref():
    q, kc, vc, bt, sl, _, _ = _batch(SEQ_LENS, 4, 2, 16, 4, torch.float32)
    out = paged_decode_attention_ref(q, kc, vc, bt, sl, 0.3)
    qsl = torch.arange(len(SEQ_LENS) + 1, dtype=torch.int32, device=DEVICE)
    torch.testing.assert_close(out, paged_attention_ref(q, kc, vc, bt, sl, qsl, 0.3))


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_key_tiles_loaded_in_row_layout(dtype, num_splits, monkeypatch):
    """GYRFALCON_DECODE_K_ROWS=1 (keys load as [keys, head_dim] and are transposed in registers): the same
    result as the reference, with the fused prep too (decode_attention_with_prep's prefetched tile)."""
    monkeypatch.setenv("GYRFALCON_DECODE_K_ROWS", "1")
    q, kc, vc, bt, sl, _, _ = _batch(SEQ_LENS, 4, 2, 32, 4, dtype, fill=10**8)
    want = paged_decode_attention_ref(q, kc, vc, bt, sl, 0.2)
    got = paged_decode_attention_triton(q, kc, vc, bt, sl, 0.2, num_splits=num_splits, block_n=16, min_part=16)
    torch.testing.assert_close(got, want, **ATTN_TOL[dtype])


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_heads,n_kv", [(2, 2), (4, 2), (8, 2)])
@pytest.mark.parametrize("num_splits,merge", [(1, True), (3, False), (3, True)],
                         ids=["direct", "reduce-kernel", "merge-in-kernel"])
def test_triton_matches_ref(dtype, n_heads, n_kv, num_splits, merge):
    # Huge ids in unused block-table entries: the kernel must not dereference them.
    q, kc, vc, bt, sl, _, _ = _batch(SEQ_LENS, n_heads, n_kv, 32, 4, dtype, fill=10**8)
    want = paged_decode_attention_ref(q, kc, vc, bt, sl, 0.2)
    for _ in range(2):  # the in-kernel merge's arrival counters must be back at zero for the next launch
        got = paged_decode_attention_triton(q, kc, vc, bt, sl, 0.2, num_splits=num_splits, block_n=16,
                                            merge_in_kernel=merge, min_part=16)
        torch.testing.assert_close(got, want, **ATTN_TOL[dtype])
        assert torch.count_nonzero(got[1]) == 0 and torch.count_nonzero(got[5]) == 0


@requires_triton
@pytest.mark.parametrize("head_dim,block_size", [(16, 16), (64, 8), (128, 16), (256, 4), (80, 8)])
def test_triton_head_dims_default_splits(head_dim, block_size):
    dtype = torch.bfloat16
    q, kc, vc, bt, sl, _, _ = _batch([20, 0, 47], 4, 2, head_dim, block_size, dtype)
    want = paged_decode_attention_ref(q, kc, vc, bt, sl, head_dim ** -0.5)
    got = paged_decode_attention_triton(q, kc, vc, bt, sl, head_dim ** -0.5)
    torch.testing.assert_close(got, want, **ATTN_TOL[dtype])


@requires_triton
@pytest.mark.parametrize("merge", [False, True], ids=["reduce-kernel", "merge-in-kernel"])
def test_triton_many_splits_non_pow2_group_and_v_dim(merge):
    # More splits than tiles (empty splits), 6 heads per kv head, V dim != K dim.
    q, kc, vc, bt, sl, _, _ = _batch([3, 40, 0, 70], 12, 2, 32, 8, torch.float32, head_dim_v=24)
    want = paged_decode_attention_ref(q, kc, vc, bt, sl, 0.2)
    for min_part in (16, 256):  # splits of one tile (several merge), or none split (each fits one split)
        got = paged_decode_attention_triton(q, kc, vc, bt, sl, 0.2, num_splits=8, block_n=16,
                                            merge_in_kernel=merge, min_part=min_part)
        assert got.shape == (4, 12, 24)
        torch.testing.assert_close(got, want, **ATTN_TOL[torch.float32])


def test_default_num_splits_depends_on_shapes_only():
    dev = torch.device("cpu")
    assert default_num_splits(64, 8, 8192, dev) == 1
    many = default_num_splits(1, 8, 8192, dev)
    assert many > 1 and many & (many - 1) == 0
    assert default_num_splits(1, 8, 256, dev) == 1  # short contexts are not split
    assert default_num_splits(1, 1, 1 << 20, dev) == MAX_SPLITS  # the grid stays small
    # The prefetching launch's wider grid: 128-key splits, up to 64 of them, still bounded by twice the
    # SM count in programs (a CPU counts as 16 SMs: 32 programs here; the H200's 132 give 64 for 8 kv heads).
    assert default_num_splits(1, 1, 8192, dev, max_splits=64, split_tokens=128) == 32
    assert default_num_splits(1, 1, 1024, dev, max_splits=64, split_tokens=128) == 8
    assert default_num_splits(1, 1, 8192, dev) == MAX_SPLITS


def test_prefetch_splits_switch(monkeypatch):
    from gyrfalcon.kernels.paged_decode_attention import prefetch_splits
    monkeypatch.delenv("GYRFALCON_DECODE_PREFETCH_SPLITS", raising=False)
    assert prefetch_splits() == MAX_SPLITS
    monkeypatch.setenv("GYRFALCON_DECODE_PREFETCH_SPLITS", "64")
    assert prefetch_splits() == 64


def test_splits_override(monkeypatch):
    """GYRFALCON_DECODE_SPLITS="B:N,...": the split count of launches of B sequences that get none from the caller;
    other batches keep the default; a malformed entry is refused with the variable's name."""
    from gyrfalcon.kernels.paged_decode_attention import splits_override
    monkeypatch.delenv("GYRFALCON_DECODE_SPLITS", raising=False)
    assert splits_override(16) is None
    monkeypatch.setenv("GYRFALCON_DECODE_SPLITS", "16:3, 64:2")
    assert splits_override(16) == 3 and splits_override(64) == 2 and splits_override(8) is None
    monkeypatch.setenv("GYRFALCON_DECODE_SPLITS", "16")
    with pytest.raises(ValueError, match="GYRFALCON_DECODE_SPLITS"):
        splits_override(16)


@requires_triton
def test_splits_override_reaches_the_launch(monkeypatch):
    """With GYRFALCON_DECODE_SPLITS the launch splits each context that many ways (5: BLOCK_S 8, where the default
    at this shape is fewer); the output matches the reference."""
    import sys
    pda = sys.modules[paged_decode_attention_triton.__module__]
    spy = LaunchSpy(pda._decode_split_kernel, "BLOCK_S")
    monkeypatch.setattr(pda, "_decode_split_kernel", spy)
    monkeypatch.setenv("GYRFALCON_DECODE_MIN_PART", "0")
    q, kc, vc, bt, sl, _, _ = _batch([70, 1, 39], 4, 2, 16, 4, torch.float32)
    want = paged_decode_attention_ref(q, kc, vc, bt, sl, 0.3)
    for env in (None, "3:5"):
        if env is None:
            monkeypatch.delenv("GYRFALCON_DECODE_SPLITS", raising=False)
        else:
            monkeypatch.setenv("GYRFALCON_DECODE_SPLITS", env)
        got = paged_decode_attention_triton(q, kc, vc, bt, sl, 0.3)
        assert (spy.seen[-1] == 8) == (env is not None), spy.seen
        torch.testing.assert_close(got, want, **ATTN_TOL[torch.float32])


def test_merge_and_key_layout_defaults(monkeypatch):
    """The in-kernel merge is on from MERGE_IN_KERNEL_MIN_SEQS sequences, key tiles in row layout (with 2
    stages) for launches of more than 128 programs without the prefetch (128-key tiles, 3 stages, on an fp8 cache
    over more than 1024); both env switches force either way."""
    from gyrfalcon.kernels.paged_decode_attention import (MERGE_IN_KERNEL_MIN_SEQS, _decode_config, k_rows,
                                                          merge_in_kernel_default, wide_tile_context)
    monkeypatch.delenv("GYRFALCON_DECODE_WIDE_TILE", raising=False)
    monkeypatch.delenv("GYRFALCON_DECODE_MERGE_IN_KERNEL", raising=False)
    monkeypatch.delenv("GYRFALCON_DECODE_K_ROWS", raising=False)
    monkeypatch.delenv("GYRFALCON_DECODE_ATTN_CONFIG", raising=False)
    monkeypatch.delenv("GYRFALCON_DECODE_MID_TILE", raising=False)
    monkeypatch.delenv("GYRFALCON_DECODE_MID_TILE_FP8", raising=False)
    assert MERGE_IN_KERNEL_MIN_SEQS == 8
    assert not merge_in_kernel_default(1) and not merge_in_kernel_default(4) and merge_in_kernel_default(8)
    assert not k_rows(128) and k_rows(129) and not k_rows(512, prefetch=True)
    # Split launches of 33-128 programs without the prefetch (the batch 8 / 16 main graphs): MID_TILE_CONFIG;
    # one split or 32 programs or fewer: 128-key tiles.
    assert _decode_config(128, 16 * 8) == (64, 4, 2) == _decode_config(128, 5 * 8)
    assert _decode_config(128, 4 * 8) == (128, 4, 3) == _decode_config(128, 16 * 8, one_split=True)
    assert _decode_config(128, 256 * 8) == (64, 4, 2)
    assert _decode_config(128, 256 * 8, prefetch=True) == (64, 8, 3)
    assert _decode_config(128, 8, prefetch=True) == (64, 8, 3)  # batch 1 with the prefetch: B1_SPLIT_TILE keys
    assert _decode_config(128, 8, prefetch=True, one_split=True) == (128, 8, 3)  # ... but one split: 128
    assert _decode_config(128, 256 * 8, fp8=True) == (128, 4, 3)  # an fp8 cache over many programs: 128-key tiles
    assert _decode_config(128, 64 * 8, fp8=True) == (64, 4, 2)  # ... over fewer, the bf16 launch
    # ... and at 33-128 programs over splits MID_TILE_CONFIG, as on a bf16 cache (since run 100)
    assert _decode_config(128, 16 * 8, fp8=True) == (64, 4, 2) == _decode_config(128, 8 * 8, fp8=True)
    assert _decode_config(128, 16 * 8, fp8=True, one_split=True) == (128, 4, 3)
    monkeypatch.setenv("GYRFALCON_DECODE_MID_TILE_FP8", "0")  # off on an fp8 cache only
    assert _decode_config(128, 16 * 8, fp8=True) == (128, 4, 3)
    assert _decode_config(128, 16 * 8) == (64, 4, 2)
    monkeypatch.delenv("GYRFALCON_DECODE_MID_TILE_FP8")
    monkeypatch.setenv("GYRFALCON_DECODE_MID_TILE", "0")  # the general switch turns both off
    assert _decode_config(128, 16 * 8, fp8=True) == (128, 4, 3)
    monkeypatch.delenv("GYRFALCON_DECODE_MID_TILE")
    # The fused prep on a 2-byte cache (wide_tile) in one split at 33-128 programs: one stage of 256-key tiles at
    # 8 warps; not over several splits, with the prefetch, an fp8 cache, head_dim 256, or outside that band.
    assert _decode_config(128, 16 * 8, one_split=True, wide_tile=True) == (256, 8, 1)
    assert _decode_config(64, 12 * 8, one_split=True, wide_tile=True) == (256, 8, 1)
    assert _decode_config(128, 8 * 8, one_split=True, wide_tile=True) == (256, 8, 1)
    assert _decode_config(128, 5 * 8, one_split=True, wide_tile=True) == (256, 8, 1)
    assert _decode_config(128, 4 * 8, one_split=True, wide_tile=True) == (128, 4, 3)
    assert _decode_config(128, 16 * 8, wide_tile=True) == (64, 4, 2)
    assert _decode_config(128, 8 * 8, wide_tile=True) == (64, 4, 2)
    assert _decode_config(128, 64 * 8, one_split=True, wide_tile=True) == (64, 4, 2)
    assert _decode_config(128, 16 * 8, prefetch=True, one_split=True, wide_tile=True) == (128, 8, 3)
    assert _decode_config(128, 16 * 8, fp8=True, one_split=True, wide_tile=True) == (128, 4, 3)
    assert _decode_config(256, 16 * 8, one_split=True, wide_tile=True) == (32, 4, 3)
    # wide_tile_context: the contexts (one tile) for which the graphs capture a one-split launch of it.
    assert wide_tile_context(16 * 8, 2, torch.device("cpu")) == 256 == wide_tile_context(5 * 8, 2, torch.device("cpu"))
    assert wide_tile_context(4 * 8, 2, torch.device("cpu")) == 0 == wide_tile_context(17 * 8, 2, torch.device("cpu"))
    assert wide_tile_context(16 * 8, 4, torch.device("cpu")) == 0 == wide_tile_context(16 * 8, 1, torch.device("cpu"))
    monkeypatch.setenv("GYRFALCON_DECODE_WIDE_TILE", "0")
    assert wide_tile_context(16 * 8, 2, torch.device("cpu")) == 0
    monkeypatch.delenv("GYRFALCON_DECODE_WIDE_TILE")
    monkeypatch.setenv("GYRFALCON_DECODE_MID_TILE", "0")
    assert _decode_config(128, 16 * 8) == (128, 4, 3) == _decode_config(128, 8 * 8, wide_tile=True)
    assert _decode_config(128, 256 * 8) == (64, 4, 2)
    monkeypatch.delenv("GYRFALCON_DECODE_MID_TILE")
    monkeypatch.setenv("GYRFALCON_DECODE_MERGE_IN_KERNEL", "0")
    monkeypatch.setenv("GYRFALCON_DECODE_K_ROWS", "0")
    assert not merge_in_kernel_default(64) and not k_rows(2048)
    assert _decode_config(128, 256 * 8) == (64, 4, 3)
    monkeypatch.setenv("GYRFALCON_DECODE_MERGE_IN_KERNEL", "1")
    monkeypatch.setenv("GYRFALCON_DECODE_K_ROWS", "1")
    assert merge_in_kernel_default(1) and k_rows(8)


@requires_triton
def test_triton_default_merge_at_batch_8(monkeypatch):
    """Eight sequences split three ways: the default launch merges in-kernel (the reduce kernel is never
    launched) and matches the reference, twice (the arrival counters are back at zero)."""
    import sys

    pda = sys.modules[paged_decode_attention_triton.__module__]  # the package re-exports a same-named function

    class _NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("the reduce kernel was launched")

    monkeypatch.delenv("GYRFALCON_DECODE_MERGE_IN_KERNEL", raising=False)
    monkeypatch.setattr(pda, "_decode_reduce_kernel", _NoLaunch())
    lens = [5, 0, 40, 17, 33, 1, 48, 26]
    q, kc, vc, bt, sl, _, _ = _batch(lens, 4, 2, 32, 4, torch.float32, fill=10**8)
    want = paged_decode_attention_ref(q, kc, vc, bt, sl, 0.2)
    for _ in range(2):
        got = paged_decode_attention_triton(q, kc, vc, bt, sl, 0.2, num_splits=3, block_n=16, min_part=16)
        torch.testing.assert_close(got, want, **ATTN_TOL[torch.float32])


def test_default_min_part(monkeypatch):
    """Batched launches (>= 128 programs, no prefetch) cover at least SHORT_SPLIT_TOKENS keys a split; batch-1
    launches and the prefetching ones one tile; GYRFALCON_DECODE_MIN_PART forces it."""
    from gyrfalcon.kernels.paged_decode_attention import SHORT_SPLIT_TOKENS, default_min_part
    monkeypatch.delenv("GYRFALCON_DECODE_MIN_PART", raising=False)
    assert SHORT_SPLIT_TOKENS == 256
    assert default_min_part(16 * 8, prefetch=False) == 256 and default_min_part(64 * 8, prefetch=False) == 256
    assert default_min_part(8, prefetch=False) == 0 and default_min_part(8 * 8, prefetch=False) == 0
    assert default_min_part(16 * 8, prefetch=True) == 0
    # MID_TILE_CONFIG's launches (the batch 8 / 16 main graphs): one tile; over more programs it does not apply.
    assert default_min_part(16 * 8, prefetch=False, mid_tile=True) == 0
    assert default_min_part(64 * 8, prefetch=False, mid_tile=True) == 256
    monkeypatch.setenv("GYRFALCON_DECODE_MIN_PART", "0")
    assert default_min_part(16 * 8, prefetch=False) == 0
    monkeypatch.setenv("GYRFALCON_DECODE_MIN_PART", "64")
    assert default_min_part(8, prefetch=True) == 64


@requires_triton
@pytest.mark.parametrize("mid_env,min_part_env,want", [("0", None, (128, 256)), (None, None, (64, 64)),
                                                        ("0", "0", (128, 128))],
                         ids=["128-key-256", "mid-tile", "128-key-one-tile"])
def test_triton_batch16_default_min_part(mid_env, min_part_env, want, monkeypatch):
    """Batch 16 at 8 kv heads (128 programs) over a graph-wide block table, in 4 splits (the H200's default split
    count there). With 128-key tiles (GYRFALCON_DECODE_MID_TILE=0) splits cover >= 256 keys by default, so contexts
    up to 256 run in one split and write directly and longer ones merge; with one-tile splits
    (GYRFALCON_DECODE_MIN_PART=0) more splits merge. By default the launch takes MID_TILE_CONFIG's 64-key tiles
    with one-tile splits. All match the reference, twice (the merge counters are back at zero), and the split
    layout the launch used (block_n, min_part) merges to the same output."""
    for name, value in (("GYRFALCON_DECODE_MIN_PART", min_part_env), ("GYRFALCON_DECODE_MID_TILE", mid_env)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    monkeypatch.delenv("GYRFALCON_DECODE_ATTN_CONFIG", raising=False)
    lens = [1, 300, 0, 129, 256, 257, 17, 200, 64, 5, 511, 128, 33, 2, 90, 160]
    q, kc, vc, bt, sl, _, _ = _batch(lens, 8, 8, 16, 16, torch.float32, fill=10**8)
    wide = torch.zeros(len(lens), 4096 // 16, dtype=bt.dtype, device=bt.device)  # max_model_len 4096
    wide[:, :bt.shape[1]] = bt
    want_out = paged_decode_attention_ref(q, kc, vc, wide, sl, 0.2)
    for _ in range(2):
        got = paged_decode_attention_triton(q, kc, vc, wide, sl, 0.2, num_splits=4)
        torch.testing.assert_close(got, want_out, **ATTN_TOL[torch.float32])
    from gyrfalcon.kernels.paged_decode_attention import _launch, merge_partials_ref
    parts = _launch(q, 8, kc, vc, wide, sl, 0.2, 4, None, partials=True)
    assert (parts.block_n, parts.min_part) == want
    torch.testing.assert_close(merge_partials_ref(parts).view_as(want_out), want_out, **ATTN_TOL[torch.float32])


FP8 = torch.float8_e4m3fn


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits,merge", [(1, None), (3, False), (3, True)])
@pytest.mark.parametrize("k_rows", ["0", "1"])
def test_fp8_cache_matches_ref(dtype, num_splits, merge, k_rows, monkeypatch):
    """kv_cache_dtype fp8: the key / value tiles load as float8 e4m3 and widen (to fp32 beside an fp32 query, to
    fp16 beside a 16-bit one; the interpreter's dots then run in fp32); the reference reads the same fp8 values
    (so the comparison is the kernel's, not fp8's, error). V's staging (GYRFALCON_DECODE_FP8_V_STAGED) is an
    asm statement on the GPU alone: tests/gpu covers it."""
    monkeypatch.setenv("GYRFALCON_DECODE_K_ROWS", k_rows)
    q, kc, vc, bt, sl, _, _ = _batch(SEQ_LENS, 4, 2, 32, 4, torch.float32, fill=10**8)
    kc8, vc8, q = kc.to(FP8), vc.to(FP8), q.to(dtype)
    want = paged_decode_attention_ref(q, kc8, vc8, bt, sl, 0.2)
    got = paged_decode_attention_triton(q, kc8, vc8, bt, sl, 0.2, num_splits=num_splits, block_n=16, min_part=16,
                                        merge_in_kernel=merge)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, **ATTN_TOL[dtype])
    # ... and the reference itself is attention over the fp8 values read back.
    torch.testing.assert_close(want, paged_decode_attention_ref(q, kc8.to(dtype), vc8.to(dtype), bt, sl, 0.2))


def _column_major(bt, width=None):
    """The same table as a [n, W] view of a column-major buffer (strides (1, n_max)), as the decode graphs hold
    it (runner/cuda_graph.DecodeInputs): block j of row i at j * n_max + i, stale entries past each row's
    blocks (they must never be read)."""
    n, w = bt.shape
    n_max, W = n + 3, max(width or w, w)
    buf = torch.full((W, n_max), 10**6, dtype=bt.dtype, device=bt.device)
    buf[:w, :n] = bt.t()
    view = buf.t()[:n]
    assert view.stride() == (1, n_max) and view.shape == (n, W)
    return view


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits,merge", [(1, True), (3, False), (3, True)])
@pytest.mark.parametrize("k_rows", ["0", "1"])
def test_column_major_block_table(dtype, num_splits, merge, k_rows, monkeypatch):
    """A block table whose entries are a column apart (the decode graphs' layout) gives the row-major result."""
    monkeypatch.setenv("GYRFALCON_DECODE_K_ROWS", k_rows)
    q, kc, vc, bt, sl, _, _ = _batch(SEQ_LENS, 4, 2, 32, 4, dtype, fill=10**8)
    want = paged_decode_attention_ref(q, kc, vc, bt, sl, 0.2)
    got = paged_decode_attention_triton(q, kc, vc, _column_major(bt, width=bt.shape[1] + 5), sl, 0.2,
                                        num_splits=num_splits, block_n=16, min_part=16, merge_in_kernel=merge)
    torch.testing.assert_close(got, want, **ATTN_TOL[dtype])


@requires_triton
@pytest.mark.parametrize("warps", ["1", "8"])
def test_reduce_warps_switch(monkeypatch, warps):
    """GYRFALCON_DECODE_REDUCE_WARPS sets the split-merge launch's warps (an experiment; default 4), the merged
    output unchanged; other values are refused."""
    import sys

    from gyrfalcon.kernels.paged_decode_attention import reduce_warps

    pda = sys.modules[paged_decode_attention_triton.__module__]
    spy = LaunchSpy(pda._decode_reduce_kernel, "num_warps")
    seen = spy.seen
    monkeypatch.delenv("GYRFALCON_DECODE_MERGE_IN_KERNEL", raising=False)
    monkeypatch.delenv("GYRFALCON_DECODE_REDUCE_WARPS", raising=False)
    assert reduce_warps() == 4
    monkeypatch.setenv("GYRFALCON_DECODE_REDUCE_WARPS", warps)
    monkeypatch.setattr(pda, "_decode_reduce_kernel", spy)
    lens = [40, 17]
    q, kc, vc, bt, sl, _, _ = _batch(lens, 4, 2, 32, 4, torch.float32)
    got = paged_decode_attention_triton(q, kc, vc, bt, sl, 0.2, num_splits=3, block_n=16, min_part=16)
    assert seen == [int(warps)]
    torch.testing.assert_close(got, paged_decode_attention_ref(q, kc, vc, bt, sl, 0.2), **ATTN_TOL[torch.float32])
    monkeypatch.setenv("GYRFALCON_DECODE_REDUCE_WARPS", "3")
    with pytest.raises(ValueError, match="GYRFALCON_DECODE_REDUCE_WARPS"):
        reduce_warps()
