"""Triton kernels vs their references on a GPU, bf16, at real model shapes (Llama-3-8B-like:
32 heads / 8 kv heads, head_dim 128, contexts up to 8k, batches up to 64), plus CUDA-graph capture
of the decode path. Run through scripts/gpu/test.sh or `pytest tests/gpu/test_kernels_gpu.py`."""

import pytest
import torch

# Skip before importing the kernels: on a CPU-only run, importing triton here (before tests/kernels'
# conftest turns the interpreter on) would leave the interpreted CPU kernel tests unable to run.
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from gyrfalcon.kernels import (  # noqa: E402
                               apply_rotary,
                               paged_attention,
                               paged_decode_attention,
                               rms_norm,
                               silu_and_mul,
                               store_kv,
                               )
from gyrfalcon.kernels.activation import silu_and_mul_ref, silu_and_mul_triton  # noqa: E402
from gyrfalcon.kernels.paged_attention import paged_attention_ref, paged_attention_triton  # noqa: E402
from gyrfalcon.kernels.decode_attention import (  # noqa: E402
                                                paged_decode_attention_ref,
                                                paged_decode_attention_triton,
                                                )
from gyrfalcon.kernels.rms_norm import rms_norm_ref, rms_norm_triton  # noqa: E402
from gyrfalcon.kernels.rotary import apply_rotary_ref, apply_rotary_triton  # noqa: E402
from gyrfalcon.kernels.store_kv import store_kv_ref, store_kv_triton  # noqa: E402

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")
BF16 = torch.bfloat16
TOL = dict(atol=2e-2, rtol=2e-2)
H, HKV, D = 32, 8, 128


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _rope_cache(max_pos, rotary_dim, base=500000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, device=DEV, dtype=torch.float32) / rotary_dim)
    ang = torch.arange(max_pos, device=DEV, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((ang.cos(), ang.sin()), dim=-1)


def _paged(seq_lens, n_kv, head_dim, block_size, dtype=BF16, width=None):
    """Random cache with shuffled blocks; unused table entries 0. -> (k_cache, v_cache, block_tables)."""
    nbs = [-(-s // block_size) for s in seq_lens]
    total = sum(nbs) + 8
    kc = torch.randn(total, block_size, n_kv, head_dim, device=DEV, dtype=dtype)
    vc = torch.randn(total, block_size, n_kv, head_dim, device=DEV, dtype=dtype)
    perm = torch.randperm(total, device=DEV)
    width = width or max(max(nbs), 1)
    bt = torch.zeros(len(seq_lens), width, dtype=torch.int32, device=DEV)
    off = 0
    for i, n in enumerate(nbs):
        bt[i, :n] = perm[off : off + n].int()
        off += n
    return kc, vc, bt


# ---------------------------------------------------------------- elementwise / norm kernels


@pytest.mark.parametrize("hidden", [4096, 5120, 8192])
def test_rms_norm(hidden):
    x = torch.randn(3000, hidden, device=DEV, dtype=BF16)
    r = torch.randn_like(x)
    w = torch.randn(hidden, device=DEV, dtype=BF16)
    torch.testing.assert_close(rms_norm_triton(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), **TOL)
    got, got_res = rms_norm_triton(x, w, 1e-5, r)
    want, want_res = rms_norm_ref(x, w, 1e-5, r)
    assert torch.equal(got_res, want_res)  # the bf16 add rounds identically on the GPU
    torch.testing.assert_close(got, want, **TOL)
    got = rms_norm_triton(x, w, 1e-5, weight_offset=1.0)
    torch.testing.assert_close(got, rms_norm_ref(x, w, 1e-5, weight_offset=1.0), **TOL)


def test_rms_norm_per_head_and_dispatch():
    qkv = torch.randn(2048, (H + 2 * HKV) * D, device=DEV, dtype=BF16)
    q = qkv[:, : H * D].view(-1, H, D)
    w = torch.randn(D, device=DEV, dtype=BF16)
    torch.testing.assert_close(rms_norm_triton(q, w, 1e-6), rms_norm_ref(q, w, 1e-6), **TOL)
    assert torch.equal(rms_norm(q, w, 1e-6), rms_norm_triton(q, w, 1e-6))  # dispatcher -> Triton


@pytest.mark.parametrize("is_neox,rotary_dim", [(True, 128), (False, 128), (True, 64)])
def test_rotary(is_neox, rotary_dim):
    T = 4096
    cs = _rope_cache(8192, rotary_dim)
    q = torch.randn(T, H, D, device=DEV, dtype=BF16)
    k = torch.randn(T, HKV, D, device=DEV, dtype=BF16)
    pos = torch.randint(0, 8192, (T,), device=DEV)
    want_q, want_k = apply_rotary_ref(q, k, pos, cs, rotary_dim, is_neox)
    got_q, got_k = apply_rotary_triton(q.clone(), k.clone(), pos, cs, rotary_dim, is_neox)
    torch.testing.assert_close(got_q, want_q, **TOL)
    torch.testing.assert_close(got_k, want_k, **TOL)
    q2, k2 = apply_rotary(q.clone(), k.clone(), pos, cs, rotary_dim, is_neox)
    torch.testing.assert_close(q2, want_q, **TOL)


def test_store_kv():
    T, nb, bs = 3000, 512, 16
    k = torch.randn(T, HKV, D, device=DEV, dtype=BF16)
    v = torch.randn(T, HKV, D, device=DEV, dtype=BF16)
    slots = torch.randperm(nb * bs, device=DEV)[:T]
    slots[::7] = -1
    kc = torch.randn(nb, bs, HKV, D, device=DEV, dtype=BF16)
    vc = torch.randn_like(kc)
    kc2, vc2 = kc.clone(), vc.clone()
    store_kv_ref(k, v, kc, vc, slots)
    store_kv_triton(k, v, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    kc3, vc3 = kc.clone(), vc.clone()
    store_kv(k, v, kc3, vc3, slots)
    assert torch.equal(kc, kc3)


def test_silu_and_mul():
    x = torch.randn(4096, 2 * 14336, device=DEV, dtype=BF16)
    torch.testing.assert_close(silu_and_mul_triton(x), silu_and_mul_ref(x), **TOL)
    assert torch.equal(silu_and_mul(x), silu_and_mul_triton(x))


# ---------------------------------------------------------------- attention


@pytest.mark.parametrize("n_heads,norm", [(16, True), (32, False)], ids=["qwen3", "llama"])
@pytest.mark.parametrize("heads", [None, 1])
def test_qkv_prep_prefill(n_heads, norm, heads):
    """fused_qkv_prep at a prefill's size (2,048 tokens: several heads per program by default) against the
    unfused references, bf16, RoPE theta 500k over 8k positions."""
    from gyrfalcon.kernels.fused_qkv_prep import heads_per_program, qkv_prep_ref, qkv_prep_triton

    T, nb, bs = 2048, 160, 16
    assert heads is not None or heads_per_program(T, n_heads) > 1
    qkv = torch.randn(T, (n_heads + 2 * HKV) * D, device=DEV, dtype=BF16)
    pos = torch.randint(0, 8192, (T,), device=DEV)
    inv = 1.0 / (500000 ** (torch.arange(0, D, 2, device=DEV).float() / D))
    freqs = torch.outer(torch.arange(8192, device=DEV).float(), inv)
    cs = torch.cat([freqs.cos(), freqs.sin()], -1)
    slots = torch.randperm(nb * bs, device=DEV)[:T]
    slots[::97] = -1
    qw = (1 + 0.3 * torch.randn(D, device=DEV)).to(BF16) if norm else None
    kw = (1 + 0.3 * torch.randn(D, device=DEV)).to(BF16) if norm else None
    kc1, vc1 = (torch.zeros(nb, bs, HKV, D, device=DEV, dtype=BF16) for _ in range(2))
    kc2, vc2 = kc1.clone(), vc1.clone()
    want = qkv_prep_ref(qkv, n_heads, HKV, D, pos, cs, D, True, kc1, vc1, slots, qw, kw, 1e-6)
    got = qkv_prep_triton(qkv, n_heads, HKV, D, pos, cs, D, True, kc2, vc2, slots, qw, kw, 1e-6, heads=heads)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(kc2, kc1, **TOL)
    torch.testing.assert_close(vc2, vc1, rtol=0, atol=0)


def _ragged_batch(q_lens, seq_lens, head_dim, n_heads, n_kv):
    """(q, k cache, v cache, block tables, seq_lens, query_start_loc, scale, the reference output) of a
    ragged batch over a paged cache of 16-token blocks."""
    kc, vc, bt = _paged(seq_lens, n_kv, head_dim, 16)
    q = torch.randn(sum(q_lens), n_heads, head_dim, device=DEV, dtype=BF16)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    scale = head_dim ** -0.5
    return q, kc, vc, bt, sl, qsl, scale, paged_attention_ref(q, kc, vc, bt, sl, qsl, scale)


@pytest.mark.parametrize("head_dim,n_heads,n_kv", [(128, 32, 8), (128, 32, 32), (64, 16, 4), (256, 16, 2)])
def test_paged_attention_ragged(head_dim, n_heads, n_kv):
    # Fresh prefill, chunked prefill over a cached prefix, decode rows and speculative verify rows.
    q, kc, vc, bt, sl, qsl, scale, want = _ragged_batch([1500, 1024, 1, 1, 4, 700],
                                                        [1500, 6000, 8192, 37, 900, 700], head_dim, n_heads, n_kv)
    got = paged_attention_triton(q, kc, vc, bt, sl, qsl, scale)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(paged_attention(q, kc, vc, bt, sl, qsl, scale, 1500, 8192), want, **TOL)


@pytest.mark.parametrize("head_dim,n_heads,n_kv", [(128, 32, 8), (128, 16, 8)])
def test_paged_attention_short_queries(head_dim, n_heads, n_kv):
    # Queries of at most paged_attention.SHORT_QUERY tokens take their own tiles: batches of short fresh
    # prompts, a 512-token chunk over a cached prefix, decode and verify rows.
    q, kc, vc, bt, sl, qsl, scale, want = _ragged_batch([128] * 8 + [512, 1, 4, 77],
                                                        [128] * 8 + [3000, 4097, 260, 77], head_dim, n_heads, n_kv)
    torch.testing.assert_close(paged_attention(q, kc, vc, bt, sl, qsl, scale, 512, 4097), want, **TOL)


def test_paged_attention_matches_sdpa_fresh_prefill():
    # Independent check against PyTorch's own causal attention on dense K/V.
    T = 4096
    kc, vc, bt = _paged([T], HKV, D, 16)
    q = torch.randn(T, H, D, device=DEV, dtype=BF16)
    nb = -(-T // 16)
    k = kc[bt[0, :nb].long()].flatten(0, 1)[:T]
    v = vc[bt[0, :nb].long()].flatten(0, 1)[:T]
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(H // HKV, 1).transpose(0, 1),
        v.repeat_interleave(H // HKV, 1).transpose(0, 1), is_causal=True, scale=D ** -0.5,
    ).transpose(0, 1)
    qsl = torch.tensor([0, T], dtype=torch.int32, device=DEV)
    sl = torch.tensor([T], dtype=torch.int32, device=DEV)
    got = paged_attention_triton(q, kc, vc, bt, sl, qsl, D ** -0.5)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("batch,max_ctx", [(1, 8192), (16, 8192), (64, 4096)])
@pytest.mark.parametrize("num_splits", [None, 1, 8])
@pytest.mark.parametrize("merge", [True, False], ids=["merge-in-kernel", "reduce-kernel"])
def test_paged_decode(batch, max_ctx, num_splits, merge):
    seq_lens = torch.randint(1, max_ctx + 1, (batch,)).tolist()
    seq_lens[0] = max_ctx
    if batch > 1:
        seq_lens[-1] = 0  # CUDA-graph padding row
    kc, vc, bt = _paged(seq_lens, HKV, D, 16, width=max_ctx // 16)
    q = torch.randn(batch, H, D, device=DEV, dtype=BF16)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    want = paged_decode_attention_ref(q, kc, vc, bt, sl, D ** -0.5)
    for _ in range(2):  # the merge's arrival counters are left at zero for the next launch
        got = paged_decode_attention_triton(q, kc, vc, bt, sl, D ** -0.5, num_splits=num_splits,
                                            merge_in_kernel=merge)
        torch.testing.assert_close(got, want, **TOL)
    if batch > 1:
        assert torch.count_nonzero(got[-1]) == 0


@pytest.mark.parametrize("batch,max_ctx", [(1, 8192), (1, 200), (8, 2048), (16, 4096), (16, 300), (16, 600),
                                           (64, 1024)])
@pytest.mark.parametrize("n_heads,norm", [(16, True), (32, False)], ids=["qwen3", "llama"])
@pytest.mark.parametrize("pdl,prefetch", [(False, False), (True, True), (True, False), (False, True)],
                         ids=["plain", "pdl-prefetch", "pdl", "prefetch"])
def test_decode_attention_with_prep(batch, max_ctx, n_heads, norm, pdl, prefetch):
    """The q/k norm + RoPE + KV store folded into the decode-attention launch, against the unfused
    references (qkv_prep_ref, then decode attention), at the default launch shapes (batch 8 / 16 without the
    prefetch: MID_TILE_CONFIG's 64-key tiles in one-tile splits); with PDL too, and with the first K/V tile loaded
    before the qkv row (PDL's default)."""
    if pdl and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm90+")
    _check_decode_attention_with_prep(batch, max_ctx, n_heads, norm, pdl, prefetch, None)


@pytest.mark.parametrize("batch,max_ctx", [(8, 256), (16, 200), (16, 256), (16, 300), (12, 129)])
@pytest.mark.parametrize("n_heads,norm", [(16, True), (32, False)], ids=["qwen3", "llama"])
def test_decode_attention_with_prep_one_split(batch, max_ctx, n_heads, norm):
    """The one-split launch the wide-tile graphs capture (batch 5-16 at 8 kv heads: WIDE_TILE_CONFIG's one-stage
    256-key tile; past 256 tokens, which those graphs never replay, two of its tiles) against the references."""
    from gyrfalcon.kernels.decode_attention import wide_tile_context
    assert wide_tile_context(batch * HKV, 2, torch.device(DEV)) == 256  # the H200 runs the wide tile here
    _check_decode_attention_with_prep(batch, max_ctx, n_heads, norm, False, False, 1)


def _check_decode_attention_with_prep(batch, max_ctx, n_heads, norm, pdl, prefetch, num_splits):
    from gyrfalcon.kernels.decode_attention import (decode_attention_with_prep_ref,
                                                    decode_attention_with_prep_triton)
    seq_lens = torch.randint(1, max_ctx + 1, (batch,)).tolist()
    seq_lens[0] = max_ctx
    if batch > 1:
        seq_lens[-1] = 0  # CUDA-graph padding row
    kc, vc, bt = _paged(seq_lens, HKV, D, 16, width=max_ctx // 16 + 1)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    pos = (sl.long() - 1).clamp(min=0)
    slots = torch.where(sl > 0, bt.long().gather(1, ((pos // 16)[:, None])).squeeze(1) * 16 + pos % 16,
                        torch.full_like(pos, -1))
    qkv = torch.randn(batch, (n_heads + 2 * HKV) * D, device=DEV, dtype=BF16)
    inv = 1.0 / (500000 ** (torch.arange(0, D, 2, device=DEV).float() / D))
    freqs = torch.outer(torch.arange(max_ctx + 1, device=DEV).float(), inv)
    cs = torch.cat([freqs.cos(), freqs.sin()], -1)
    qw = (1 + 0.3 * torch.randn(D, device=DEV)).to(BF16) if norm else None
    kw = (1 + 0.3 * torch.randn(D, device=DEV)).to(BF16) if norm else None
    kc_ref, vc_ref = kc.clone(), vc.clone()
    want = decode_attention_with_prep_ref(qkv, n_heads, HKV, D, pos, cs, D, True, kc_ref, vc_ref, slots, bt, sl,
                                          D ** -0.5, None, qw, kw, 1e-6)
    got = decode_attention_with_prep_triton(qkv, n_heads, HKV, D, pos, cs, D, True, kc, vc, slots, bt, sl,
                                            D ** -0.5, num_splits, qw, kw, 1e-6, pdl=pdl, prefetch=prefetch)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(kc, kc_ref, **TOL)
    torch.testing.assert_close(vc, vc_ref, rtol=0, atol=0)


@pytest.mark.parametrize("head_dim,n_heads,n_kv", [(64, 16, 4), (256, 16, 2), (128, 64, 8)])
def test_paged_decode_head_dims(head_dim, n_heads, n_kv):
    seq_lens = [3000, 1, 17, 0, 5000]
    kc, vc, bt = _paged(seq_lens, n_kv, head_dim, 16)
    q = torch.randn(len(seq_lens), n_heads, head_dim, device=DEV, dtype=BF16)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    want = paged_decode_attention_ref(q, kc, vc, bt, sl, head_dim ** -0.5)
    torch.testing.assert_close(paged_decode_attention(q, kc, vc, bt, sl, head_dim ** -0.5), want, **TOL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_attention_other_dtypes(dtype):
    seq_lens, q_lens = [300, 1000], [300, 8]
    kc, vc, bt = _paged(seq_lens, HKV, D, 16, dtype=dtype)
    q = torch.randn(sum(q_lens), H, D, device=DEV, dtype=dtype)
    qsl = torch.tensor([0, 300, 308], dtype=torch.int32, device=DEV)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    tol = dict(atol=5e-3, rtol=5e-3)
    torch.testing.assert_close(paged_attention_triton(q, kc, vc, bt, sl, qsl, 0.08),
                               paged_attention_ref(q, kc, vc, bt, sl, qsl, 0.08), **tol)
    qd = q[:2].contiguous()
    torch.testing.assert_close(paged_decode_attention_triton(qd, kc, vc, bt, sl, 0.08, num_splits=4),
                               paged_decode_attention_ref(qd, kc, vc, bt, sl, 0.08), **tol)


def test_decode_cuda_graph_capture():
    # Capture once with static buffers, replay with new contexts: no host syncs, no data-dependent
    # allocation inside the kernels' launchers.
    B, max_ctx = 8, 2048
    kc, vc, _ = _paged([max_ctx] * B, HKV, D, 16)
    bt = torch.arange(B * (max_ctx // 16), device=DEV, dtype=torch.int32).view(B, -1)
    q = torch.randn(B, H, D, device=DEV, dtype=BF16)
    sl = torch.full((B,), 100, dtype=torch.int32, device=DEV)
    k_new = torch.randn(B, HKV, D, device=DEV, dtype=BF16)
    slots = torch.zeros(B, dtype=torch.long, device=DEV)

    def step():
        store_kv(k_new, k_new, kc, vc, slots)
        return paged_decode_attention(q, kc, vc, bt, sl, D ** -0.5)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm up (compile) outside capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()
    for lens in ([2048, 1, 0, 77, 1500, 16, 17, 999], [5] * B):
        sl.copy_(torch.tensor(lens, dtype=torch.int32))
        slots.copy_((bt[:, 0].long() * 16 + (torch.tensor(lens, device=DEV) - 1).clamp(min=0)) *
                    (torch.tensor(lens, device=DEV) > 0) - (torch.tensor(lens, device=DEV) == 0).long())
        q.normal_()
        g.replay()
        torch.cuda.synchronize()
        want = paged_decode_attention_ref(q, kc, vc, bt, sl, D ** -0.5)
        torch.testing.assert_close(out, want, **TOL)


@pytest.mark.parametrize("S,V", [(1, 151936), (64, 128256)])
def test_gumbel_argmax_real_vocab(S, V):
    from gyrfalcon.kernels.sampling import gumbel_argmax_ref, gumbel_argmax_triton, hash_uniform_ref

    g = torch.Generator(device=DEV).manual_seed(S)
    z = torch.randn(S, V, device=DEV, generator=g) * 4
    z[:, ::3] = float("-inf")  # a masked third (as top-k / top-p leave it)
    seeds = torch.randint(0, 2**62, (S,), device=DEV, generator=g)
    offsets = torch.randint(0, 2**40, (S,), device=DEV, generator=g)
    got = gumbel_argmax_triton(z, seeds, offsets)
    want = gumbel_argmax_ref(z, seeds, offsets)
    assert (got % 3 != 0).all()
    score = z - torch.log(-torch.log(hash_uniform_ref(seeds, offsets, V)))
    chosen = score.gather(1, got.unsqueeze(1)).squeeze(1)
    assert torch.all(score.max(dim=-1).values - chosen <= 1e-4 * chosen.abs().clamp(min=1))
    assert (got == want).float().mean() >= 0.95


@pytest.mark.parametrize("T,V,Hd", [(1, 151936, 1024), (16, 128256, 4096), (64, 151936, 1024)])
def test_embedding_with_pending(T, V, Hd):
    """The decode graphs' embedding lookup that resolves tokens still on the device: bit-exact."""
    from gyrfalcon.kernels.embedding import (embedding_with_pending, embedding_with_pending_ref,
                                             embedding_with_pending_triton)

    weight = torch.randn(V, Hd, device=DEV, dtype=BF16)
    ids = torch.randint(0, V, (T,), device=DEV)
    last = torch.randint(0, V, (T,), device=DEV)
    src = torch.where(torch.rand(T, device=DEV) < 0.5, torch.randperm(T, device=DEV), -1)
    want = embedding_with_pending_ref(weight, ids, src, last)
    assert torch.equal(embedding_with_pending_triton(weight, ids, src, last), want)
    assert torch.equal(embedding_with_pending(weight, ids, src, last), want)


# ---------------------------------------------------------------- fp8 KV cache (kv_cache_dtype="fp8")

FP8 = torch.float8_e4m3fn


def _fp8_ulp_close(got, want):
    """fp8 e4m3 values equal, or one rounding step apart (the fused kernels round fp32 -> fp8 once, the
    unfused references fp32 -> bf16 -> fp8): 3 mantissa bits, a step is 1/8 of the binade."""
    g, w = got.float(), want.float()
    assert torch.all((g - w).abs() <= w.abs() / 8 + 2 ** -9), (g - w).abs().max()


def test_store_kv_fp8_rounds_like_torch():
    k = torch.randn(4096, HKV, D, device=DEV, dtype=BF16) * 3
    v = torch.randn(4096, HKV, D, device=DEV, dtype=BF16) * 3
    kc = torch.zeros(512, 16, HKV, D, device=DEV, dtype=FP8)
    vc = torch.zeros_like(kc)
    kr, vr = kc.clone(), vc.clone()
    slots = torch.randperm(512 * 16, device=DEV)[:4096]
    store_kv_ref(k, v, kr, vr, slots)
    store_kv_triton(k, v, kc, vc, slots)
    assert torch.equal(kc.view(torch.uint8), kr.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), vr.view(torch.uint8))


@pytest.mark.parametrize("batch,max_ctx", [(1, 8192), (16, 4096), (8, 2048), (256, 1024)])
def test_paged_decode_fp8_cache(batch, max_ctx):
    """fp8 tiles widened to fp16 for the dots, V widened in its row layout, pinned there by an asm statement, and
    staged through shared memory; batch 8 / 16 on MID_TILE_CONFIG's 64-key tiles, batch 256 on 128-key ones."""
    seq_lens = torch.randint(1, max_ctx + 1, (batch,)).tolist()
    seq_lens[0] = max_ctx
    kc, vc, bt = _paged(seq_lens, HKV, D, 16, width=max_ctx // 16)
    kc, vc = kc.to(FP8), vc.to(FP8)
    q = torch.randn(batch, H, D, device=DEV, dtype=BF16)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    want = paged_decode_attention_ref(q, kc, vc, bt, sl, D ** -0.5)
    torch.testing.assert_close(paged_decode_attention_triton(q, kc, vc, bt, sl, D ** -0.5), want, **TOL)


def test_paged_prefill_fp8_cache():
    """fp16 dots beside the bf16 query; decode-like rows (a 1-token query over 900 keys) as a throughput run's
    mixed steps hold them."""
    q_lens, seq_lens = [512, 1, 300, 128], [512, 900, 1300, 128]
    kc, vc, bt = _paged(seq_lens, HKV, D, 16, width=1300 // 16 + 1)
    kc, vc = kc.to(FP8), vc.to(FP8)
    q = torch.randn(sum(q_lens), H, D, device=DEV, dtype=BF16)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    want = paged_attention_ref(q, kc, vc, bt, sl, qsl, D ** -0.5)
    torch.testing.assert_close(paged_attention_triton(q, kc, vc, bt, sl, qsl, D ** -0.5), want, **TOL)


@pytest.mark.parametrize("pdl,prefetch", [(False, False), (True, True)], ids=["plain-mid-tile", "pdl-prefetch"])
def test_decode_attention_with_prep_fp8_cache(pdl, prefetch):
    """The fused launch rounds the new token into the fp8 cache (within one step of the unfused path's
    double rounding) and attends over the fp8 cache; batch 16's split launch on MID_TILE_CONFIG."""
    from gyrfalcon.kernels.decode_attention import (decode_attention_with_prep_ref,
                                                    decode_attention_with_prep_triton)
    if pdl and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm90+")
    batch, max_ctx, n_heads = (1 if pdl else 16), 2000, 32
    seq_lens = torch.randint(1, max_ctx + 1, (batch,)).tolist()
    seq_lens[0] = max_ctx
    kc, vc, bt = _paged(seq_lens, HKV, D, 16, width=max_ctx // 16 + 1)
    kc, vc = kc.to(FP8), vc.to(FP8)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    pos = (sl.long() - 1).clamp(min=0)
    slots = bt.long().gather(1, ((pos // 16)[:, None])).squeeze(1) * 16 + pos % 16
    qkv = torch.randn(batch, (n_heads + 2 * HKV) * D, device=DEV, dtype=BF16)
    inv = 1.0 / (500000 ** (torch.arange(0, D, 2, device=DEV).float() / D))
    cs = torch.cat([torch.outer(torch.arange(max_ctx + 1, device=DEV).float(), inv).cos(),
                    torch.outer(torch.arange(max_ctx + 1, device=DEV).float(), inv).sin()], -1)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    want = decode_attention_with_prep_ref(qkv, n_heads, HKV, D, pos, cs, D, True, kc_ref, vc_ref, slots, bt, sl,
                                          D ** -0.5, None, None, None, 1e-6)
    got = decode_attention_with_prep_triton(qkv, n_heads, HKV, D, pos, cs, D, True, kc, vc, slots, bt, sl,
                                            D ** -0.5, None, None, None, 1e-6, pdl=pdl, prefetch=prefetch)
    _fp8_ulp_close(kc, kc_ref)
    _fp8_ulp_close(vc, vc_ref)
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


def test_max_shared_mem_reads_the_device():
    """common.max_shared_mem reads Triton's driver property: the H100 / H200 (sm_90) allow 227 KB a program
    (H200_MAX_SHARED, what the CPU tests assume); any card at least 48 KB."""
    from gyrfalcon.kernels.common import H200_MAX_SHARED, max_shared_mem
    smem = max_shared_mem(torch.device("cuda"))
    assert 48 * 1024 <= smem <= 256 * 1024
    if torch.cuda.get_device_capability()[0] == 9:
        assert smem == H200_MAX_SHARED
