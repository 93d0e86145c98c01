"""benchmarks/overlap_probe.py's layer at toy shapes on the CPU (kernels under the interpreter): the two halves'
chains, as its two-stream schedules run them, compute what the whole batch's chain does (rows are independent),
so the probe times the same work either way."""

from __future__ import annotations

import torch

from benchmark_scripts import load_benchmark
from kernels_testutil import requires_triton


@requires_triton
def test_halves_compute_the_whole_batch(monkeypatch):
    probe = load_benchmark("overlap_probe")
    for name, v in (("H", 4), ("KV", 2), ("D", 16), ("HID", 32), ("INTER", 48)):
        monkeypatch.setattr(probe, name, v)
    torch.manual_seed(0)
    B, ctx = 6, 21
    layers, inp = probe.make_layers(B, ctx, 2, dev="cpu", dtype=torch.float32)
    resid0 = torch.randn(B, probe.HID) * 0.1
    whole = resid0.clone()
    for attn, mlp in probe.layer_fns(layers, inp, slice(0, B), whole):
        mlp(attn())
    kv_after_whole = [(kc.clone(), vc.clone()) for _, kc, vc in layers]
    split = resid0.clone()
    ha = probe.layer_fns(layers, inp, slice(0, B // 2), split[:B // 2])
    hb = probe.layer_fns(layers, inp, slice(B // 2, B), split[B // 2:])
    for (aa, ma), (ab, mb) in zip(ha, hb):
        ma(aa())
        mb(ab())
    assert not torch.equal(whole, resid0)  # the layers did change the residual stream
    torch.testing.assert_close(split, whole, rtol=1e-4, atol=1e-5)
    for (_, kc, vc), (kw, vw) in zip(layers, kv_after_whole):  # the new tokens' K/V, written again, are the same
        torch.testing.assert_close(kc, kw)
        torch.testing.assert_close(vc, vw)
