"""The attention backend interface: the reference backend (plain torch) and the Triton backend (its kernels, in
the interpreter off a GPU) give the same attention for a paged batch, including steps where every sequence
carries 1 + k query tokens (a speculative verify step) over a cached prefix, and those equal running the tokens
one at a time as decode steps. graph_variants is the decode graphs' one-split policy; capture_metadata the batch
each graph variant captures."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gyrfalcon.forward_context import forward_context
from gyrfalcon.layers.attention import Attention, AttentionBackend, get_backend
from gyrfalcon.layers.attention.reference import ReferenceBackend
from gyrfalcon.layers.rotary import RotaryEmbedding
from layers_testutil import kv_cache, step_batch

H, HKV, D, BS = 4, 2, 16, 8
PREFIX = [5, 11, 16]  # cached tokens per sequence before the step
TABLES = [[3, 0, 7], [1, 5, 8], [2, 6, 4, 9]]
TOL = dict(rtol=1e-4, atol=1e-4)


def _triton_backend():
    pytest.importorskip("triton")
    from gyrfalcon.kernels.common import HAS_TRITON
    if not HAS_TRITON:
        pytest.skip("Triton unavailable")
    from gyrfalcon.layers.attention.triton import TritonBackend
    return TritonBackend()


def _setup(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    layer = Attention(H, HKV, D, D ** -0.5, layer_idx=0)
    rotary = RotaryEmbedding(D, D, 64, None)
    norms = (torch.rand(D, generator=g) + 0.5, torch.rand(D, generator=g) + 0.5, 1e-6)
    caches = kv_cache(10, BS, HKV, D)
    # The cached prefixes, written by a reference prefill.
    fb = step_batch([0] * 3, PREFIX, TABLES, BS)
    qkv = torch.randn(sum(PREFIX), (H + 2 * HKV) * D, generator=g)
    with forward_context(fb, [caches]):
        ReferenceBackend().forward_fused(layer, qkv, fb.positions, rotary, norms)
    return g, layer, rotary, norms, caches


def _run(backend, layer, caches, fb, fn):
    caches = tuple(c.clone() for c in caches)
    with forward_context(fb, [caches]):
        out = fn(backend)
    return out, caches


@pytest.mark.parametrize("k", [0, 1, 2, 3, 4])
def test_multi_token_step_matches_one_token_at_a_time(k):
    """Each sequence carries 1 + k tokens (fused path: qkv rows, per-head norms, RoPE, row scale): the reference
    and the Triton backend agree on the output and on the cache they leave, and both equal k + 1 decode steps
    of one token each."""
    triton_backend = _triton_backend()
    g, layer, rotary, norms, caches = _setup()
    n = 1 + k
    fb = step_batch(PREFIX, [n] * 3, TABLES, BS)
    assert fb.is_decode == (k == 0)
    qkv = torch.randn(3 * n, (H + 2 * HKV) * D, generator=g)
    x = torch.randn(3 * n, 32, generator=g)  # a folded input norm's rows: qkv scaled by rstd(x)
    step = lambda be, qkv=qkv, x=x, fb=fb: be.forward_fused(layer, qkv, fb.positions, rotary, norms, (x, 1e-6))
    outs = {}
    for name, be in (("reference", ReferenceBackend()), ("triton", triton_backend)):
        o, c = _run(be, layer, caches, fb, step)
        # The same tokens one at a time: token j of every sequence in a decode step.
        c1 = tuple(t.clone() for t in caches)
        singles = []
        for j in range(n):
            rows = torch.arange(3) * n + j
            fb1 = step_batch([p + j for p in PREFIX], [1] * 3, TABLES, BS)
            with forward_context(fb1, [c1]):
                singles.append(be.forward_fused(layer, qkv[rows], fb1.positions, rotary, norms, (x[rows], 1e-6)))
        one_by_one = torch.stack(singles, 1).reshape(3 * n, H * D)
        torch.testing.assert_close(o, one_by_one, **TOL)
        torch.testing.assert_close(c[0], c1[0], **TOL)
        torch.testing.assert_close(c[1], c1[1], **TOL)
        outs[name] = (o, c)
    torch.testing.assert_close(outs["triton"][0], outs["reference"][0], **TOL)
    for a, b in zip(outs["triton"][1], outs["reference"][1]):
        torch.testing.assert_close(a, b, **TOL)


def test_unfused_forward_and_one_split_metadata():
    """forward(layer, q, k, v) (the unfused path: K/V stored, then attention) agrees across backends for a
    3-token step and a decode step; the decode step captured as the "one_split" variant gives the same output."""
    triton_backend = _triton_backend()
    g, layer, rotary, norms, caches = _setup(1)
    for n in (3, 1):
        fb = step_batch(PREFIX, [n] * 3, TABLES, BS)
        q, k, v = (torch.randn(3 * n, h, D, generator=g) for h in (H, HKV, HKV))
        ref, _ = _run(ReferenceBackend(), layer, caches, fb, lambda be: be.forward(layer, q, k, v))
        tri, _ = _run(triton_backend, layer, caches, fb, lambda be: be.forward(layer, q, k, v))
        torch.testing.assert_close(tri, ref, **TOL)
    one = triton_backend.capture_metadata(fb, "one_split")
    assert one.decode_num_splits == 1 and fb.decode_num_splits is None
    tri1, _ = _run(triton_backend, layer, caches, one, lambda be: be.forward(layer, q, k, v))
    torch.testing.assert_close(tri1, ref, **TOL)


def test_capture_metadata_variants():
    fb = step_batch([4, 9], [1, 1], [[0], [1, 2]], BS)
    for be in (ReferenceBackend(), AttentionBackend()):
        assert be.capture_metadata(fb, "main") is fb
        assert be.capture_metadata(fb, "one_split") == dataclasses.replace(fb, decode_num_splits=1)
        with pytest.raises(ValueError, match="graph variant"):
            be.capture_metadata(fb, "merged")


def test_graph_variants_policy():
    """The sizes up to 4 replay a one-split graph up to 128 tokens of context; the sizes whose one-split launch
    takes the wide 256-key tile (33-128 (sequence, kv head) programs, 2-byte cache) up to 256; only limits short of
    max_model_len. The reference backend (the CPU's eager stand-in for graphs) takes the same choices."""
    cpu = torch.device("cpu")
    sizes = [1, 2, 4, 8, 16, 24, 32]
    from gyrfalcon.layers.attention.triton import ONE_SPLIT_CONTEXT, ONE_SPLIT_MAX_BATCH, one_split_graph_limits
    assert (ONE_SPLIT_MAX_BATCH, ONE_SPLIT_CONTEXT) == (4, 128)
    for be in (ReferenceBackend(), get_backend(cpu)):
        gv = be.graph_variants
        assert gv(sizes, 8, 2, 4096, cpu) == {1: 128, 2: 128, 4: 128, 8: 256, 16: 256}
        assert gv(sizes, 4, 2, 4096, cpu) == {1: 128, 2: 128, 4: 128, 16: 256, 24: 256, 32: 256}
        assert gv(sizes, 8, 4, 4096, cpu) == {1: 128, 2: 128, 4: 128}  # fp32 cache: no wide tile
        assert gv(sizes, 8, 2, 256, cpu) == {1: 128, 2: 128, 4: 128}
        assert gv(sizes, 8, 2, 128, cpu) == {}
        assert gv(sizes, 8, 2, 4096, cpu) == one_split_graph_limits(sizes, 8, 2, 4096, cpu)


def test_get_backend(monkeypatch):
    """Reference off CUDA (and with GYRFALCON_KERNELS=ref), one instance per kind."""
    from gyrfalcon import envs
    cpu = torch.device("cpu")
    assert isinstance(get_backend(cpu), ReferenceBackend) and get_backend(cpu) is get_backend(cpu)
    monkeypatch.setenv("GYRFALCON_KERNELS", "ref")
    envs.refresh()
    assert get_backend(torch.device("cuda", 0)).name == "reference"
