import pytest
import torch

from gyrfalcon.kernels.paged_attention import paged_attention_ref
from gyrfalcon.kernels.decode_attention import (
    MAX_SPLITS,
    default_num_splits,
    paged_decode_attention_ref,
    paged_decode_attention_triton,
)
from kernels_testutil import (ATTN_TOL, DEVICE, DTYPES, make_paged_kv, naive_causal_attention,
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
def test_key_tiles_loaded_in_row_layout(dtype, num_splits):
    """key_rows=True (keys load as [keys, head_dim] and are transposed in registers, the many-program launches'
    layout): the same result as the reference."""
    q, kc, vc, bt, sl, _, _ = _batch(SEQ_LENS, 4, 2, 32, 4, dtype, fill=10**8)
    want = paged_decode_attention_ref(q, kc, vc, bt, sl, 0.2)
    got = paged_decode_attention_triton(q, kc, vc, bt, sl, 0.2, num_splits=num_splits, block_n=16, min_part=16,
                                        key_rows=True)
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
    assert default_num_splits(1, 1, 8192, dev) == MAX_SPLITS


def test_merge_and_key_layout_defaults():
    """The in-kernel merge is on from MERGE_IN_KERNEL_MIN_SEQS sequences, key tiles in row layout (with 2
    stages) for launches of more than 128 programs without the prefetch (128-key tiles, 3 stages, on an fp8 cache
    over more than 1024)."""
    from gyrfalcon.kernels.decode_attention import (MERGE_IN_KERNEL_MIN_SEQS, decode_config, k_rows,
                                                    merge_in_kernel_default, wide_tile_context)
    assert MERGE_IN_KERNEL_MIN_SEQS == 8
    assert not merge_in_kernel_default(1) and not merge_in_kernel_default(4) and merge_in_kernel_default(8)
    assert not k_rows(128) and k_rows(129) and not k_rows(512, prefetch=True)
    # Split launches of 33-128 programs without the prefetch (the batch 8 / 16 main graphs): MID_TILE_CONFIG;
    # one split or 32 programs or fewer: 128-key tiles.
    assert decode_config(128, 16 * 8) == (64, 4, 2) == decode_config(128, 5 * 8)
    assert decode_config(128, 4 * 8) == (128, 4, 3) == decode_config(128, 16 * 8, one_split=True)
    assert decode_config(128, 256 * 8) == (64, 4, 2)
    assert decode_config(128, 256 * 8, prefetch=True) == (64, 8, 3)
    assert decode_config(128, 8, prefetch=True) == (64, 8, 3)  # batch 1 with the prefetch: B1_SPLIT_TILE keys
    assert decode_config(128, 8, prefetch=True, one_split=True) == (128, 8, 3)  # ... but one split: 128
    assert decode_config(128, 256 * 8, fp8=True) == (128, 4, 3)  # an fp8 cache over many programs: 128-key tiles
    assert decode_config(128, 64 * 8, fp8=True) == (64, 4, 2)  # ... over fewer, the bf16 launch
    # ... and at 33-128 programs over splits MID_TILE_CONFIG, as on a bf16 cache
    assert decode_config(128, 16 * 8, fp8=True) == (64, 4, 2) == decode_config(128, 8 * 8, fp8=True)
    assert decode_config(128, 16 * 8, fp8=True, one_split=True) == (128, 4, 3)
    # The fused prep on a 2-byte cache (wide_tile) in one split at 33-128 programs: one stage of 256-key tiles at
    # 8 warps; not over several splits, with the prefetch, an fp8 cache, head_dim 256, or outside that band.
    assert decode_config(128, 16 * 8, one_split=True, wide_tile=True) == (256, 8, 1)
    assert decode_config(64, 12 * 8, one_split=True, wide_tile=True) == (256, 8, 1)
    assert decode_config(128, 8 * 8, one_split=True, wide_tile=True) == (256, 8, 1)
    assert decode_config(128, 5 * 8, one_split=True, wide_tile=True) == (256, 8, 1)
    assert decode_config(128, 4 * 8, one_split=True, wide_tile=True) == (128, 4, 3)
    assert decode_config(128, 16 * 8, wide_tile=True) == (64, 4, 2)
    assert decode_config(128, 8 * 8, wide_tile=True) == (64, 4, 2)
    assert decode_config(128, 64 * 8, one_split=True, wide_tile=True) == (64, 4, 2)
    assert decode_config(128, 16 * 8, prefetch=True, one_split=True, wide_tile=True) == (128, 8, 3)
    assert decode_config(128, 16 * 8, fp8=True, one_split=True, wide_tile=True) == (128, 4, 3)
    assert decode_config(256, 16 * 8, one_split=True, wide_tile=True) == (32, 4, 3)
    # wide_tile_context: the contexts (one tile) for which the graphs capture a one-split launch of it.
    assert wide_tile_context(16 * 8, 2, torch.device("cpu")) == 256 == wide_tile_context(5 * 8, 2, torch.device("cpu"))
    assert wide_tile_context(4 * 8, 2, torch.device("cpu")) == 0 == wide_tile_context(17 * 8, 2, torch.device("cpu"))
    assert wide_tile_context(16 * 8, 4, torch.device("cpu")) == 0 == wide_tile_context(16 * 8, 1, torch.device("cpu"))


@requires_triton
def test_triton_default_merge_at_batch_8(monkeypatch):
    """Eight sequences split three ways: the default launch merges in-kernel (the reduce kernel is never
    launched) and matches the reference, twice (the arrival counters are back at zero)."""
    import sys

    pda = sys.modules[paged_decode_attention_triton.__module__]  # the package re-exports a same-named function

    class _NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("the reduce kernel was launched")

    monkeypatch.setattr(pda, "_decode_reduce_kernel", _NoLaunch())
    lens = [5, 0, 40, 17, 33, 1, 48, 26]
    q, kc, vc, bt, sl, _, _ = _batch(lens, 4, 2, 32, 4, torch.float32, fill=10**8)
    want = paged_decode_attention_ref(q, kc, vc, bt, sl, 0.2)
    for _ in range(2):
        got = paged_decode_attention_triton(q, kc, vc, bt, sl, 0.2, num_splits=3, block_n=16, min_part=16)
        torch.testing.assert_close(got, want, **ATTN_TOL[torch.float32])


def test_default_min_part():
    """Batched launches (>= 128 programs, no prefetch) cover at least SHORT_SPLIT_TOKENS keys a split; batch-1
    launches and the prefetching ones one tile."""
    from gyrfalcon.kernels.decode_attention import SHORT_SPLIT_TOKENS, default_min_part
    assert SHORT_SPLIT_TOKENS == 256
    assert default_min_part(16 * 8, prefetch=False) == 256 and default_min_part(64 * 8, prefetch=False) == 256
    assert default_min_part(8, prefetch=False) == 0 and default_min_part(8 * 8, prefetch=False) == 0
    assert default_min_part(16 * 8, prefetch=True) == 0
    # MID_TILE_CONFIG's launches (the batch 8 / 16 main graphs): one tile; over more programs it does not apply.
    assert default_min_part(16 * 8, prefetch=False, mid_tile=True) == 0
    assert default_min_part(64 * 8, prefetch=False, mid_tile=True) == 256


@requires_triton
@pytest.mark.parametrize("config,min_part", [((128, 4, 3), None), (None, None), ((128, 4, 3), 0)],
                         ids=["128-key-256", "mid-tile", "128-key-one-tile"])
def test_triton_batch16_split_layouts(config, min_part):
    """Batch 16 at 8 kv heads (128 programs) over a graph-wide block table, in 4 splits (the H200's default split
    count there). With 128-key tiles splits cover >= 256 keys by default, so contexts up to 256 run in one split
    and write directly and longer ones merge; with one-tile splits (min_part=0) more splits merge. By default the
    launch takes MID_TILE_CONFIG's 64-key tiles with one-tile splits. All match the reference, twice (the merge
    counters are back at zero)."""
    lens = [1, 300, 0, 129, 256, 257, 17, 200, 64, 5, 511, 128, 33, 2, 90, 160]
    q, kc, vc, bt, sl, _, _ = _batch(lens, 8, 8, 16, 16, torch.float32, fill=10**8)
    wide = torch.zeros(len(lens), 4096 // 16, dtype=bt.dtype, device=bt.device)  # max_model_len 4096
    wide[:, :bt.shape[1]] = bt
    want_out = paged_decode_attention_ref(q, kc, vc, wide, sl, 0.2)
    bn, nw, ns = config or (None, None, None)
    for _ in range(2):
        got = paged_decode_attention_triton(q, kc, vc, wide, sl, 0.2, num_splits=4, block_n=bn, num_warps=nw,
                                            num_stages=ns, min_part=min_part)
        torch.testing.assert_close(got, want_out, **ATTN_TOL[torch.float32])


FP8 = torch.float8_e4m3fn


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits,merge", [(1, None), (3, False), (3, True)])
@pytest.mark.parametrize("k_rows", [False, True])
def test_fp8_cache_matches_ref(dtype, num_splits, merge, k_rows):
    """kv_cache_dtype fp8: the key / value tiles load as float8 e4m3 and widen (to fp32 beside an fp32 query, to
    fp16 beside a 16-bit one; the interpreter's dots then run in fp32); the reference reads the same fp8 values
    (so the comparison is the kernel's, not fp8's, error). V's staging (the kernel's V_STAGE) is an asm statement
    on the GPU alone: tests/gpu covers it."""
    q, kc, vc, bt, sl, _, _ = _batch(SEQ_LENS, 4, 2, 32, 4, torch.float32, fill=10**8)
    kc8, vc8, q = kc.to(FP8), vc.to(FP8), q.to(dtype)
    want = paged_decode_attention_ref(q, kc8, vc8, bt, sl, 0.2)
    got = paged_decode_attention_triton(q, kc8, vc8, bt, sl, 0.2, num_splits=num_splits, block_n=16, min_part=16,
                                        merge_in_kernel=merge, key_rows=k_rows)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, **ATTN_TOL[dtype])
    # ... and the reference itself is attention over the fp8 values read back.
    torch.testing.assert_close(want, paged_decode_attention_ref(q, kc8.to(dtype), vc8.to(dtype), bt, sl, 0.2))
