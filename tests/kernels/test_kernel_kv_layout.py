"""Every kernel addresses the KV cache [blocks, block_size, kv heads, head_dim] through its strides, not its
contiguity: on a cache stored [blocks, kv heads, block_size, head_dim] and handed over as the permuted view,
each kernel that reads or writes it (store, qkv prep with its KV write, prefill attention, decode attention
with and without the fused prep) must give the same results as on the contiguous cache, under the
interpreter; so must the torch references (the CPU path). (The engine stores it contiguously: the permuted
layout measured no faster on the H200.)"""

from __future__ import annotations

import pytest
import torch

from gyrfalcon.kernels.fused_qkv_prep import qkv_prep_ref, qkv_prep_triton
from gyrfalcon.kernels.paged_attention import paged_attention_ref, paged_attention_triton
from gyrfalcon.kernels.decode_attention import (decode_attention_with_prep_ref,
                                                decode_attention_with_prep_triton, paged_decode_attention_ref,
                                                paged_decode_attention_triton)
from gyrfalcon.kernels.store_kv import store_kv_ref, store_kv_triton

NB, BS, KVH, D, H = 12, 16, 2, 32, 4
EXACT = dict(rtol=0, atol=0)


def _nhd() -> torch.Tensor:
    """A zeroed cache in the engine's layout [blocks, block_size, kv heads, head_dim], contiguous."""
    return torch.zeros(NB, BS, KVH, D)


def _hnd_view() -> torch.Tensor:
    """A zeroed cache stored [blocks, kv heads, block_size, head_dim], seen as [blocks, block_size, kv heads, ...]."""
    return torch.zeros(NB, KVH, BS, D).permute(0, 2, 1, 3)


def _pair(g):
    """The same random contents in both layouts: (contiguous, permuted view)."""
    nhd = _nhd()
    nhd.copy_(torch.randn(NB, BS, KVH, D, generator=g))
    hnd = _hnd_view()
    hnd.copy_(nhd)
    return nhd, hnd


def test_permuted_view_is_strided():
    c = _hnd_view()
    assert c.shape == (NB, BS, KVH, D) and c.stride() == (KVH * BS * D, D, BS * D, 1)
    n = _nhd()
    assert n.is_contiguous() and n.shape == c.shape and not n.any()


@pytest.mark.parametrize("impl", ["triton", "ref"])
def test_writes_land_in_the_same_logical_places(impl):
    g = torch.Generator().manual_seed(0)
    (kn, kh), (vn, vh) = _pair(g), _pair(g)
    T = 5
    slots = torch.tensor([3, 17, 40, -1, 191])
    k, v = torch.randn(T, KVH, D, generator=g), torch.randn(T, KVH, D, generator=g)
    store = store_kv_triton if impl == "triton" else store_kv_ref
    store(k, v, kn, vn, slots)
    store(k, v, kh, vh, slots)
    torch.testing.assert_close(kh, kn, **EXACT)
    torch.testing.assert_close(vh, vn, **EXACT)
    # and the qkv prep's own KV write (RoPE'd K, V as is)
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g)
    pos = torch.tensor([3, 17, 40, 0, 191])
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    cs = torch.cat([torch.outer(torch.arange(200).float(), inv).cos(),
                    torch.outer(torch.arange(200).float(), inv).sin()], -1)
    prep = qkv_prep_triton if impl == "triton" else qkv_prep_ref
    qn = prep(qkv, H, KVH, D, pos, cs, D, True, kn, vn, slots, None, None, 1e-6)
    qh = prep(qkv, H, KVH, D, pos, cs, D, True, kh, vh, slots, None, None, 1e-6)
    torch.testing.assert_close(qh, qn, **EXACT)
    torch.testing.assert_close(kh, kn, **EXACT)
    torch.testing.assert_close(vh, vn, **EXACT)


@pytest.mark.parametrize("impl", ["triton", "ref"])
def test_attention_reads_the_same_on_both_layouts(impl):
    g = torch.Generator().manual_seed(1)
    (kn, kh), (vn, vh) = _pair(g), _pair(g)
    bt = torch.randperm(NB, generator=g)[:9].to(torch.int32).view(3, 3)
    seq_lens = torch.tensor([40, 17, 33], dtype=torch.int32)
    scale = D ** -0.5
    # decode: one query per sequence
    q = torch.randn(3, H, D, generator=g)
    dec = paged_decode_attention_triton if impl == "triton" else paged_decode_attention_ref
    torch.testing.assert_close(dec(q, kh, vh, bt, seq_lens, scale), dec(q, kn, vn, bt, seq_lens, scale), **EXACT)
    # prefill with a cached prefix: the last 5 / 17 / 2 tokens of each sequence are this step's queries
    qlens = torch.tensor([5, 17, 2])
    qsl = torch.zeros(4, dtype=torch.int32)
    qsl[1:] = torch.cumsum(qlens, 0)
    qp = torch.randn(int(qsl[-1]), H, D, generator=g)
    pre = paged_attention_triton if impl == "triton" else paged_attention_ref
    torch.testing.assert_close(pre(qp, kh, vh, bt, seq_lens, qsl, scale, 17, 40),
                               pre(qp, kn, vn, bt, seq_lens, qsl, scale, 17, 40), **EXACT)
    # decode with the fused prep (writes the new token at position seq_len - 1, then attends)
    qkv = torch.randn(3, (H + 2 * KVH) * D, generator=g)
    pos = seq_lens.long() - 1
    slots = bt.long().gather(1, (pos // BS)[:, None]).squeeze(1) * BS + pos % BS
    inv = 1.0 / (500000 ** (torch.arange(0, D, 2).float() / D))
    cs = torch.cat([torch.outer(torch.arange(48).float(), inv).cos(),
                    torch.outer(torch.arange(48).float(), inv).sin()], -1)
    fused = decode_attention_with_prep_triton if impl == "triton" else decode_attention_with_prep_ref
    args = (H, KVH, D, pos, cs, D, True)
    on_h = fused(qkv, *args, kh, vh, slots, bt, seq_lens, scale)
    on_n = fused(qkv, *args, kn, vn, slots, bt, seq_lens, scale)
    torch.testing.assert_close(on_h, on_n, **EXACT)
    torch.testing.assert_close(kh, kn, **EXACT)
    torch.testing.assert_close(vh, vn, **EXACT)
