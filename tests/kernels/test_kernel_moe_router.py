"""The one-launch MoE router selection (kernels/moe_router triton.py) against the torch reference, under
TRITON_INTERPRET=1 (compiled on a GPU): the same experts in the same order and the same weights, for softmax and
sigmoid scoring, with and without normalization, bias and scaling, E not a power of two, k from 1 to 8."""

from __future__ import annotations

import pytest
import torch

from kernels_testutil import DEVICE, requires_triton

from gyrfalcon.kernels.moe_router import route, route_ref, route_triton


def _logits(T, E, dtype, seed):
    """[T, E] logits free of ties: each row a permutation of distinct multiples of 1/16 in [-E/32, E/32), exact in
    bf16 too (torch.topk's order among equal scores is unspecified); and a [E] fp32 bias."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.stack([torch.randperm(E, generator=g) for _ in range(T)]).float()
    return ((rows - E / 2) / 16).to(dtype).to(DEVICE), (0.1 * torch.randn(E, generator=g)).to(DEVICE)


@requires_triton
@pytest.mark.parametrize("E,k", [(8, 1), (8, 2), (60, 4), (128, 8), (256, 8)])
@pytest.mark.parametrize("scoring,norm,use_bias,scale", [
    ("softmax", True, False, 1.0), ("softmax", False, False, 1.0),
    ("sigmoid", True, True, 1.0), ("sigmoid", True, True, 2.5), ("sigmoid", False, False, 1.0)])
def test_matches_reference(E, k, scoring, norm, use_bias, scale):
    for dtype in (torch.float32, torch.bfloat16):
        logits, bias = _logits(5, E, dtype, seed=E * 10 + k)
        b = bias if use_bias else None
        want_w, want_i = route_ref(logits, k, scoring, norm, b, routed_scaling_factor=scale)
        got_w, got_i = route_triton(logits, k, scoring, norm, b, routed_scaling_factor=scale)
        assert got_i.dtype == torch.int64 and got_w.dtype == torch.float32 and got_w.shape == (5, k)
        assert torch.equal(got_i.cpu(), want_i.cpu())
        torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)


@requires_triton
def test_bias_changes_the_choice_not_the_weights():
    """A bias that lifts two low-scoring experts into the top 2: they are chosen, weighted by their own unbiased
    scores (hand-computed: sigmoid(-1), sigmoid(-2), normalized)."""
    logits = torch.tensor([[3.0, 2.0, -1.0, -2.0]], device=DEVICE)
    bias = torch.tensor([0.0, 0.0, 5.0, 4.0], device=DEVICE)
    w, i = route_triton(logits, 2, "sigmoid", True, bias)
    s = torch.sigmoid(torch.tensor([-1.0, -2.0]))
    assert i.cpu().tolist() == [[2, 3]]
    torch.testing.assert_close(w.cpu(), (s / s.sum()).unsqueeze(0))


@requires_triton
def test_empty_batch_and_dispatch():
    w, i = route_triton(torch.empty(0, 8, device=DEVICE), 2, "softmax")
    assert w.shape == (0, 2) and i.shape == (0, 2)
    # Grouped selection (DeepSeek's noaux_tc) is the reference's on any device.
    logits, bias = _logits(3, 16, torch.float32, 0)
    got = route(logits, 4, "sigmoid", True, bias, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    want = route_ref(logits, 4, "sigmoid", True, bias, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


@requires_triton
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_garbage_rows_still_pick_distinct_experts_in_range(scoring):
    """NaN and -inf logits (a CUDA-graph capture pass runs the model over unwritten cache memory): each row still
    gets k distinct expert ids in [0, E), which the grouped GEMMs and the sort index by."""
    E, k = 60, 8
    logits = torch.randn(4, E, device=DEVICE)
    logits[0] = float("nan")
    logits[1] = float("-inf")
    logits[2, ::2] = float("nan")
    _, ids = route_triton(logits, k, scoring, True, torch.zeros(E, device=DEVICE) if scoring == "sigmoid" else None)
    ids = ids.cpu()
    assert ids.min() >= 0 and ids.max() < E
    assert all(len(set(r.tolist())) == k for r in ids)
    _, want = route_ref(logits[3:], k, scoring)
    assert torch.equal(ids[3], want[0].cpu())
