"""benchmarks/small_m_gemv.py --attn-real builds a throughput run's decode-attention inputs (a whole KV pool,
consecutive or scattered blocks, the new token's slot) and times the plain and fused-prep decode kernels on
them; here the inputs' invariants, and both kernel calls exactly as the benchmark makes them, under the
interpreter against the references."""

from __future__ import annotations

import pytest
import torch

from gyrfalcon.kernels.paged_decode_attention import (decode_attention_with_prep_ref,
                                                      decode_attention_with_prep_triton, paged_decode_attention_ref,
                                                      paged_decode_attention_triton)

from benchmark_scripts import load_benchmark


@pytest.mark.parametrize("scattered", [False, True], ids=["consecutive", "scattered"])
def test_real_decode_inputs_and_kernel_calls(scattered):
    bench = load_benchmark("small_m_gemv")
    B, ctx, pool_blocks = 3, 37, 40  # 3 blocks per sequence, 9 of the pool's 40
    pool = bench.kv_pool(pool_blocks, "cpu", n_kv=2, d=32, dtype=torch.float32)
    assert pool[0].shape == (pool_blocks, 16, 2, 32) and pool[0].is_contiguous()
    x = bench.real_decode_inputs(B, ctx, pool, scattered, n_heads=4, seed=1)
    bt, d = x["bt"], x["d"]
    ids = bt.flatten().tolist()
    assert bt.shape == (B, 3) and len(set(ids)) == len(ids) and all(0 <= i < pool_blocks for i in ids)
    assert (ids == list(range(9))) != scattered
    assert x["positions"].tolist() == [ctx - 1] * B and x["cos_sin"].shape == (ctx, d)
    # the new token's slot: offset 4 of each sequence's third block
    assert x["slots"].tolist() == [bt[i, 2].item() * 16 + 4 for i in range(B)]
    # the benchmark's two calls, against their references
    q = x["qkv"][:, :x["n_heads"] * d].reshape(B, x["n_heads"], d).contiguous()
    got = paged_decode_attention_triton(q, x["k_cache"], x["v_cache"], bt, x["seq_lens"], d ** -0.5)
    want = paged_decode_attention_ref(q, x["k_cache"], x["v_cache"], bt, x["seq_lens"], d ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    kc, vc = x["k_cache"].clone(), x["v_cache"].clone()
    args = (x["n_heads"], x["n_kv"], d, x["positions"], x["cos_sin"], d, True)
    want = decode_attention_with_prep_ref(x["qkv"], *args, kc, vc, x["slots"], bt, x["seq_lens"], d ** -0.5)
    got = decode_attention_with_prep_triton(x["qkv"], *args, x["k_cache"], x["v_cache"], x["slots"], bt,
                                            x["seq_lens"], d ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(x["k_cache"], kc, rtol=1e-5, atol=1e-5)  # the new token's K, rotated, stored


def test_ab_rounds_alternate_and_restore_the_switch(monkeypatch):
    """small_m_gemv.ab_rounds: A B, B A, ... with the variable at each value ("unset": removed), restored after."""
    import os

    bench = load_benchmark("small_m_gemv")
    monkeypatch.setenv("GYRFALCON_AB_PROBE", "keep")
    seen = []
    ab = bench.ab_rounds(lambda: seen.append(os.environ.get("GYRFALCON_AB_PROBE")) or 1.0, "GYRFALCON_AB_PROBE",
                         "unset", "7", rounds=3)
    assert seen == [None, "7", "7", None, None, "7"]
    assert ab == {"unset": [1.0, 1.0, 1.0], "7": [1.0, 1.0, 1.0]}
    assert os.environ["GYRFALCON_AB_PROBE"] == "keep"
