"""benchmarks/l2_prefetch_probe.py's schedules at toy shapes on the CPU (kernels under the interpreter, where the
prefetch and its side branch are no-ops): every schedule runs, and the layer with the prefetch block computes what
the plain layer does (the block wraps attention without changing it), so the probe times the same work."""

from __future__ import annotations

import torch

from benchmark_scripts import load_benchmark
from kernels_testutil import requires_triton


@requires_triton
def test_schedules_run_and_agree(monkeypatch):
    probe = load_benchmark("l2_prefetch_probe")
    for name, v in (("H", 4), ("KV", 2), ("D", 16), ("HID", 32), ("INTER", 48)):
        monkeypatch.setattr(probe.op, name, v)
    monkeypatch.setenv("GYRFALCON_ATTN_L2_PREFETCH", "512")
    torch.manual_seed(0)
    B, ctx = 4, 21
    resid0 = torch.randn(B, 32) * 0.1
    results = {}
    for kind in ("seq", "seq_pf", "seq_pfn"):
        torch.manual_seed(1)  # the same weights and caches for both
        layers, inp = probe.op.make_layers(B, ctx, 2, dev="cpu", dtype=torch.float32)
        resid = resid0.clone()
        probe.schedules(layers, inp, resid)[kind]()
        results[kind] = resid
    assert not torch.equal(results["seq"], resid0)
    torch.testing.assert_close(results["seq_pf"], results["seq"])
    torch.testing.assert_close(results["seq_pfn"], results["seq"])
    layers, inp = probe.op.make_layers(B, ctx, 2, dev="cpu", dtype=torch.float32)
    bodies = probe.schedules(layers, inp, resid0.clone())
    for kind in ("attn", "attn_pf", "o", "o_pf"):
        bodies[kind]()
