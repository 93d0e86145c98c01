"""MLA's fused prep kernels (kernels/mla_prep) under the interpreter against their references (the unfused
composition of RMSNorm / LayerNorm / RoPE / cache-write / bmm references): the kv prep's cache rows (latent and, for
V3.2, indexer keys) written through a ragged step's slot mapping into shuffled, partly filled blocks with skipped
slots, its q_a norm; the q prep's absorbed query (decode-sized and prefill-sized token blocks, dims that are no
power of two) and V3.2's index query and weights; the V projection into o_proj's layout. Plus the references
against plain formulas."""

import math

import pytest
import torch

from gyrfalcon.kernels.mla_prep import (IndexKeyPrep, IndexQueryPrep, mla_kv_prep_ref, mla_kv_prep_triton,
                                        mla_q_prep_ref, mla_q_prep_triton, mla_v_proj_ref, mla_v_proj_triton)
from gyrfalcon.layers.rotary import RotaryEmbedding
from kernels_testutil import DEVICE, TOL, requires_triton

L, R, Q = 40, 8, 24  # kv_lora_rank, qk_rope_head_dim, q_lora_rank (no powers of two: the masks are exercised)


def _close(a, b):
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)  # fp32 math in a different order


def _table(is_neox: bool) -> torch.Tensor:
    return RotaryEmbedding(R, R, 128, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                       "mscale": 1.0, "mscale_all_dim": 1.0}, 128, is_neox).cos_sin_cache.to(DEVICE)


def _step(block_size=4, num_blocks=9):
    """A ragged step: a prefill chunk of 7 after a 2-token prefix, two decode rows, a padded row (slot -1) -> (positions
    [T], slot_mapping [T]) over shuffled blocks (partly filled: the chunk ends mid-block)."""
    perm = torch.randperm(num_blocks).tolist()
    seqs = [(2, 7), (5, 1), (12, 1)]  # (cached prefix, new tokens)
    pos, slots = [], []
    for prefix, new in seqs:
        blocks = [perm.pop() for _ in range(-(-(prefix + new) // block_size))]
        for p in range(prefix, prefix + new):
            pos.append(p)
            slots.append(blocks[p // block_size] * block_size + p % block_size)
    pos.append(0)
    slots.append(-1)
    return (torch.tensor(pos, dtype=torch.int64, device=DEVICE), torch.tensor(slots, dtype=torch.int64, device=DEVICE))


def _kv_inputs(dtype, with_q: bool, D=None, block_size=4):
    positions, slots = _step(block_size)
    T = positions.shape[0]
    # kv as the strided view a fused [q_a | kv_a] GEMM output would be (a row stride past L + R).
    kv = torch.randn(T, L + R + 5, device=DEVICE).to(dtype)[:, :L + R]
    cache = torch.randn(9, block_size, 1, L + R, device=DEVICE).to(dtype)
    kv_w = (1 + 0.3 * torch.randn(L, device=DEVICE)).to(dtype)
    q_a = torch.randn(T, Q, device=DEVICE).to(dtype) if with_q else None
    q_w = (1 + 0.3 * torch.randn(Q, device=DEVICE)).to(dtype) if with_q else None
    index = None
    if D is not None:
        index = IndexKeyPrep(torch.randn(T, D, device=DEVICE).to(dtype) * 3 + 1,
                             (1 + 0.3 * torch.randn(D, device=DEVICE)).to(dtype),
                             (0.2 * torch.randn(D, device=DEVICE)).to(dtype), 1e-6,
                             torch.randn(9, block_size, 1, D, device=DEVICE).to(dtype))
    return positions, slots, kv, cache, kv_w, q_a, q_w, index


def _clone_index(index):
    return index._replace(cache=index.cache.clone()) if index is not None else None


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["v3", "q_proj", "v32", "v32_rotate_half"])
def test_kv_prep_matches_reference(dtype, variant):
    """The cache rows (every slot: written ones equal, skipped / foreign ones untouched) and RMSNorm(q_a)."""
    is_neox = variant == "v32_rotate_half"
    D = 24 if variant.startswith("v32") else None
    positions, slots, kv, cache, kv_w, q_a, q_w, index = _kv_inputs(dtype, variant != "q_proj", D)
    cs = _table(is_neox)
    c_ref, i_ref = cache.clone(), _clone_index(index)
    want = mla_kv_prep_ref(kv, positions, cs, R, is_neox, kv_w, 1e-6, c_ref, slots, q_a, q_w, i_ref)
    got = mla_kv_prep_triton(kv, positions, cs, R, is_neox, kv_w, 1e-6, cache, slots, q_a, q_w, index)
    tol = TOL[dtype]
    torch.testing.assert_close(cache.float(), c_ref.float(), **tol)
    if variant == "q_proj":
        assert got is None and want is None
    else:
        torch.testing.assert_close(got.float(), want.float(), **tol)
    if index is not None:
        torch.testing.assert_close(index.cache.float(), i_ref.cache.float(), **tol)
    # The step's rows did change the cache (a write that never happened cannot pass the comparison above).
    s = slots[0].item()
    assert not torch.equal(cache[s // 4, s % 4], _kv_inputs(dtype, False)[3][s // 4, s % 4])


def test_kv_prep_ref_is_the_formulas():
    """The reference's cache row is [latent / rms * w | k_rope rotated by interleaved pairs], its index key the
    LayerNorm'd key rotated by halves on its first R dims."""
    positions, slots, kv, cache, kv_w, q_a, q_w, index = _kv_inputs(torch.float32, True, 24)
    cs = _table(False)
    q_resid = mla_kv_prep_ref(kv, positions, cs, R, False, kv_w, 1e-6, cache, slots, q_a, q_w, index)
    _close(q_resid, q_a / q_a.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * q_w)
    t, s = 3, slots[3].item()
    p = positions[t].item()
    row = cache[s // 4, s % 4, 0]
    lat = kv[t, :L]
    _close(row[:L], lat / lat.pow(2).mean().add(1e-6).sqrt() * kv_w)
    cos, sin = cs[p, :R // 2], cs[p, R // 2:]
    x = kv[t, L:]
    _close(row[L::2], x[0::2] * cos - x[1::2] * sin)
    _close(row[L + 1::2], x[1::2] * cos + x[0::2] * sin)
    k = index.k[t]
    kn = (k - k.mean()) / (k.var(unbiased=False) + 1e-6).sqrt() * index.weight + index.bias
    krow = index.cache[s // 4, s % 4, 0]
    h = R // 2
    _close(krow[:h], kn[:h] * cos - kn[h:R] * sin)
    _close(krow[h:R], kn[h:R] * cos + kn[:h] * sin)
    _close(krow[R:], kn[R:])


def _q_inputs(T, H, nope, dtype, HI=None, D=None):
    positions = torch.randint(0, 128, (T,), device=DEVICE)
    q = torch.randn(T, H, nope + R + 3, device=DEVICE).to(dtype)[..., :nope + R]  # strided like a GEMM slice
    w_kvb = (torch.randn(H, nope + 12, L, device=DEVICE) / math.sqrt(nope)).to(dtype)  # kv_b_proj per head [k | v]
    index = None
    if HI is not None:
        index = IndexQueryPrep(torch.randn(T, HI, D, device=DEVICE).to(dtype), torch.randn(T, HI, device=DEVICE),
                               HI ** -0.5 * D ** -0.5)
    return positions, q, w_kvb[:, :nope], index


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,index", [(1, False), (5, True), (70, True), (0, True)],
                         ids=["decode", "small_v32", "prefill_v32", "empty"])
@pytest.mark.parametrize("is_neox", [False, True], ids=["interleaved", "rotate_half"])
def test_q_prep_matches_reference(dtype, T, index, is_neox):
    """q_abs = [q_nope @ W_UK | RoPE(q_rope)] over one and several token blocks (70 > the prefill block of 64) and
    W_UK as kv_b_proj's strided per-head view; V3.2's index query (rotate_half on its first R dims) and weights."""
    H, nope = 3, 24
    positions, q, w_uk, iq = _q_inputs(T, H, nope, dtype, *((5, 24) if index else (None, None)))
    cs = _table(is_neox)
    want, want_i = mla_q_prep_ref(q, positions, cs, R, is_neox, w_uk, iq)
    got, got_i = mla_q_prep_triton(q, positions, cs, R, is_neox, w_uk, iq)
    assert got.shape == want.shape == (T, H, L + R)
    tol = dict(atol=2e-4, rtol=2e-4) if dtype == torch.float32 else TOL[dtype]  # a dot over nope products
    torch.testing.assert_close(got.float(), want.float(), **tol)
    if index:
        torch.testing.assert_close(got_i[0].float(), want_i[0].float(), **TOL[dtype])
        assert got_i[1].dtype == torch.float32
        torch.testing.assert_close(got_i[1], want_i[1], rtol=1e-6, atol=1e-6)
    else:
        assert got_i is None and want_i is None


def test_q_prep_ref_is_the_absorbed_query():
    """The reference's q_abs per head: the nope part times W_UK, the rope part rotated by interleaved pairs."""
    positions, q, w_uk, iq = _q_inputs(4, 2, 16, torch.float32, 3, 16)
    cs = _table(False)
    q_abs, (iq_out, w) = mla_q_prep_ref(q, positions, cs, R, False, w_uk, iq)
    _close(q_abs[2, 1, :L], q[2, 1, :16] @ w_uk[1])
    p = positions[2].item()
    cos, sin = cs[p, :R // 2], cs[p, R // 2:]
    x = q[2, 1, 16:]
    _close(q_abs[2, 1, L::2], x[0::2] * cos - x[1::2] * sin)
    _close(w, iq.w * iq.w_scale)
    _close(iq_out[2, :, R:], iq.q[2, :, R:])
    _close(iq_out[2, :, :R // 2], iq.q[2, :, :R // 2] * cos - iq.q[2, :, R // 2:R] * sin)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 70, 0])
def test_v_proj_matches_reference(dtype, T):
    """o_proj's input [T, H * v] = per head o_latent @ W_UV^T, W_UV as kv_b_proj's strided per-head view."""
    H, nope, V = 3, 16, 12
    o = torch.randn(T, H, L, device=DEVICE).to(dtype)
    w_kvb = (torch.randn(H, nope + V, L, device=DEVICE) / math.sqrt(L)).to(dtype)
    w_uv = w_kvb[:, nope:]
    want = mla_v_proj_ref(o, w_uv)
    got = mla_v_proj_triton(o, w_uv)
    assert got.shape == want.shape == (T, H * V)
    tol = dict(atol=2e-4, rtol=2e-4) if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), **tol)
    if T:
        torch.testing.assert_close(want[-1, V:2 * V].float(), (o[-1, 1].float() @ w_uv[1].float().T),
                                   **TOL[dtype])


@requires_triton
def test_launches_specialize_once_across_batch_shapes(monkeypatch):
    """Token counts of 2-47 (odd, even, multiples of 16) compile one variant of each prep kernel per token-block
    constexpr: Triton's integer specialization (1 / a multiple of 16 / the rest) would otherwise recompile mid-run."""
    pytest.importorskip("triton._C.libtriton", reason="needs Triton's native_specialize_impl")
    from triton.runtime.interpreter import InterpretedFunction

    from gyrfalcon.kernels._specialization import launch_signature

    seen: dict = {}

    def run(self, *args, grid, warmup, **kwargs):
        sig = launch_signature(self, args, kwargs)
        const = tuple(a for a in sig if a[1] == "tl.constexpr")
        seen.setdefault((self.fn.__name__, const), set()).add(sig)
    monkeypatch.setattr(InterpretedFunction, "run", run)
    H, nope = 3, 16
    for T in (2, 5, 16, 17, 32, 47):
        positions, slots = torch.zeros(T, dtype=torch.int64), torch.zeros(T, dtype=torch.int64)
        kv = torch.zeros(T, Q + 16 + L + R)  # a fused GEMM's output: [q_a | wk | kv_a]
        index = IndexKeyPrep(kv[:, Q:Q + 16], torch.ones(16), torch.zeros(16), 1e-6, torch.zeros(4, 4, 1, 16))
        mla_kv_prep_triton(kv[:, Q + 16:], positions, _table(False), R, False, torch.ones(L), 1e-6,
                           torch.zeros(4, 4, 1, L + R), slots, kv[:, :Q], torch.ones(Q), index)
        _, q, w_uk, iq = _q_inputs(T, H, nope, torch.float32, 4, 16)
        mla_q_prep_triton(q, positions, _table(False), R, False, w_uk, iq)
        mla_v_proj_triton(torch.zeros(T, H, L), torch.zeros(H, 12, L))
    assert {k[0] for k in seen} == {"_mla_kv_prep_kernel", "_mla_q_prep_kernel", "_mla_v_proj_kernel"}
    varied = {k[0]: len(v) for k, v in seen.items() if len(v) > 1}
    assert not varied, varied
