"""Greedy argmax: the two-stage Triton kernel against torch's argmax (ties -> first index, all -inf rows,
NaN as the maximum, +-0), the launch-shape rule, and the dispatcher's choice of path."""

from __future__ import annotations

import pytest
import torch

from gyrfalcon.kernels.argmax import (
    TORCH_MIN_ROWS,
    argmax_launch,
    greedy_argmax,
    greedy_argmax_ref,
    greedy_argmax_triton,
)
from kernels_testutil import DEVICE, requires_triton

NAN, INF = float("nan"), float("inf")
# Small launch shapes for the interpreter: 64-element iterations, >= 128-element chunks.
SMALL = dict(block=64, min_chunk=128)


def _check(x, **kw):
    got = greedy_argmax_triton(x.to(DEVICE), **kw).cpu()
    want = greedy_argmax_ref(x)
    assert got.dtype == torch.int64 and got.shape == want.shape
    assert torch.equal(got, want), (got, want)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("S,V,kw", [(1, 1000, SMALL), (3, 5003, dict(block=256, min_chunk=512)),
                                    (17, 1000, SMALL), (3, 40000, {}), (17, 40000, {})])
def test_matches_torch(S, V, kw, dtype):
    g = torch.Generator().manual_seed(S * V)
    _check((torch.randn(S, V, generator=g) * 4).to(dtype), **kw)
    # Small integers: ties everywhere (within a lane, across lanes, across chunks).
    _check(torch.randint(-3, 4, (S, V), generator=g).to(dtype), **kw)


@requires_triton
def test_ties_at_chunk_boundaries_go_to_the_lower_index():
    V = 1000
    chunk, P = argmax_launch(1, V, **SMALL)
    assert (chunk, P) == (128, 8)
    x = torch.zeros(6, V)
    x[0, [chunk - 1, chunk]] = 5  # the last of one chunk and the first of the next
    x[1, [chunk, 2 * chunk, 5 * chunk + 7]] = 5  # first elements of two chunks, and a later one
    x[2, [3 * chunk + 5, 3 * chunk + 5 + 64, 7 * chunk + 1]] = 5  # one lane, two iterations; a later chunk
    x[3, [V - 1, 7 * chunk]] = 5  # both in the last (partial) chunk
    x[4, -1] = 5  # the max is the last element
    x[5] = torch.arange(V, dtype=torch.float32)  # increasing: the last element again
    _check(x, **SMALL)
    assert greedy_argmax_triton(x.to(DEVICE), **SMALL).tolist() == [chunk - 1, chunk, 3 * chunk + 5, 7 * chunk, V - 1, V - 1]


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_special_values(dtype):
    V = 700
    x = torch.randn(8, V)
    x[0] = -INF  # all -inf -> 0, as torch
    x[1, :] = -INF
    x[1, 400] = -1e30  # one finite entry among -inf
    x[2, [10, 300]] = INF  # +inf ties
    x[3, [50, 600]] = NAN  # NaN is the maximum, the first NaN wins
    x[4, 5] = INF
    x[4, 650] = NAN  # NaN beats an earlier +inf
    x[5] = -1.0
    x[5, [200, 20]] = torch.tensor([0.0, -0.0])  # -0.0 == +0.0: the first of them
    x[6] = -torch.rand(V) - 1
    x[6, 0] = -0.5  # the max is the first element
    x[7, -1] = 100.0  # the max is the last element
    x = x.to(dtype)
    _check(x, **SMALL)
    _check(x)  # one program per row: stage 1 writes the answer
    assert greedy_argmax_triton(x.to(DEVICE), **SMALL).tolist()[:6] == [0, 400, 10, 50, 650, 20]
    # NaNs with a sign bit (x86's 0/0) and other payloads count too.
    y = torch.zeros(2, V)
    y[0, 123] = -NAN
    y[1, 77] = torch.tensor(0x7F800001, dtype=torch.int32).view(torch.float32)  # signalling NaN
    y[1, 500] = INF
    _check(y, **SMALL)
    # Subnormals are not zero.
    z = torch.full((2, V), -1.0)
    z[0, [30, 60]] = torch.tensor([0.0, 1e-40])
    z[1, [30, 60]] = torch.tensor([-1e-40, -0.0])
    _check(z, **SMALL)


@requires_triton
def test_strided_rows_and_fp16():
    wide = torch.randn(5, 1200)
    x = wide[:, 100:1100]  # rows 1200 apart, last dim contiguous
    _check(x, **SMALL)
    _check(wide.half(), **SMALL)
    assert greedy_argmax_triton(torch.empty(0, 50, device=DEVICE)).shape == (0,)


def test_launch_shape():
    # Few rows: ~512 programs, chunks of >= 4096 elements, whole 4096-element iterations.
    assert argmax_launch(1, 128256) == (4096, 32)
    assert argmax_launch(1, 151936) == (4096, 38)
    assert argmax_launch(16, 151936) == (8192, 19)
    assert argmax_launch(64, 128256) == (16384, 8)
    for S in (1, 2, 7, 16, 64, 100, TORCH_MIN_ROWS - 1):
        for V in (1, 1000, 4096, 32000, 128256, 151936, 262144):
            chunk, P = argmax_launch(S, V)
            assert chunk % 4096 == 0 and (P - 1) * chunk < V <= P * chunk
            assert P == 1 or S * P <= 512 + S  # about 512 programs at most
    assert argmax_launch(TORCH_MIN_ROWS, 128256) is None


def test_dispatch_on_cpu_is_torch(monkeypatch):
    import gyrfalcon.kernels.argmax as am

    def never(*a, **k):
        raise AssertionError("the Triton path must not run on a CPU tensor")

    monkeypatch.setattr(am, "greedy_argmax_triton", never)
    x = torch.randn(3, 5000)
    x[1, [7, 9]] = 50.0
    assert torch.equal(am.greedy_argmax(x), x.argmax(dim=-1))


def test_dispatch_falls_back_to_torch_when_the_kernel_fails(monkeypatch):
    import gyrfalcon.kernels.argmax as am

    def broken(*a, **k):
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(am, "use_triton", lambda t: True)
    monkeypatch.setattr(am, "greedy_argmax_triton", broken)
    monkeypatch.setattr(am, "_TRITON_FAILED", False)
    x = torch.randn(2, 300)
    assert torch.equal(am.greedy_argmax(x), x.argmax(-1))
    assert am._TRITON_FAILED


def test_dispatch_many_rows_take_torch(monkeypatch):
    import gyrfalcon.kernels.argmax as am

    calls = []
    monkeypatch.setattr(am, "use_triton", lambda t: True)
    monkeypatch.setattr(am, "_TRITON_FAILED", False)
    monkeypatch.setattr(am, "greedy_argmax_triton", lambda t: calls.append(t.shape) or t.argmax(-1))
    am.greedy_argmax(torch.randn(TORCH_MIN_ROWS, 64))
    am.greedy_argmax(torch.randn(TORCH_MIN_ROWS - 1, 64))
    assert calls == [(TORCH_MIN_ROWS - 1, 64)]
    assert torch.equal(greedy_argmax(torch.tensor([[1.0, 3.0, 3.0]])), torch.tensor([1]))
