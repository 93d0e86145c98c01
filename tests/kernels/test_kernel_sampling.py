"""Gumbel-max draw from hashed uniforms: the Triton kernel against its torch reference, and the
reference against the distribution it must sample from."""

from __future__ import annotations

import pytest
import torch

from gyrfalcon.kernels.sampling import gumbel_argmax_ref, gumbel_argmax_triton, hash_uniform_ref, row_keys
from kernels_testutil import DEVICE, requires_triton


def test_uniforms_in_open_interval_and_spread():
    seeds = torch.tensor([0, 1, 2**40 + 7, 2**62], dtype=torch.int64)
    offsets = torch.tensor([0, 0, 5, 2**33], dtype=torch.int64)
    u = hash_uniform_ref(seeds, offsets, 4096)
    assert u.shape == (4, 4096) and u.dtype == torch.float32
    assert (u > 0).all() and (u < 1).all()
    for row in u:
        assert abs(row.mean().item() - 0.5) < 0.02
        assert abs(row.var().item() - 1 / 12) < 0.01
        # Equal-width bins fill evenly (no structure from consecutive indices).
        counts = torch.histc(row, bins=16, min=0, max=1)
        assert counts.min() > 4096 / 16 * 0.7
    # Different seeds, offsets and rows give different streams.
    assert len({tuple(r[:8].tolist()) for r in u}) == 4
    assert not torch.equal(row_keys(seeds[:1], offsets[:1] + 1), row_keys(seeds[:1], offsets[:1]))


def test_reference_samples_the_softmax_distribution():
    torch.manual_seed(0)
    V, n = 12, 20000
    z = torch.randn(V) * 1.5
    z[3] = float("-inf")  # masked: never drawn
    draws = gumbel_argmax_ref(z.expand(n, V), torch.full((n,), 42, dtype=torch.int64), torch.arange(n))
    freq = torch.bincount(draws, minlength=V).float() / n
    want = z.softmax(-1)
    assert freq[3] == 0
    # Each frequency within 4.5 standard errors of its probability.
    se = (want * (1 - want) / n).sqrt()
    assert ((freq - want).abs() <= 4.5 * se + 1e-4).all(), (freq, want)


def test_reference_is_deterministic_per_seed_and_offset():
    z = torch.randn(3, 64)
    s, o = torch.tensor([7, 7, 8]), torch.tensor([1, 2, 1])
    a = gumbel_argmax_ref(z, s, o)
    assert torch.equal(a, gumbel_argmax_ref(z.clone(), s.clone(), o.clone()))
    # Row 0 alone draws what it drew in the batch.
    assert gumbel_argmax_ref(z[:1], s[:1], o[:1]).item() == a[0].item()


@requires_triton
@pytest.mark.parametrize("S,V,block", [(1, 37, 16), (5, 300, 64), (3, 1000, 128)])
def test_triton_matches_reference(S, V, block):
    g = torch.Generator().manual_seed(S * V)
    z = (torch.randn(S, V, generator=g) * 3).to(DEVICE)
    z[0, : V // 2] = float("-inf")  # a masked half
    seeds = torch.randint(0, 2**62, (S,), generator=g).to(DEVICE)
    offsets = torch.randint(0, 2**40, (S,), generator=g).to(DEVICE)
    got = gumbel_argmax_triton(z, seeds, offsets, block=block)
    # The same uniforms; the scores' logs may differ by an ulp between implementations, so a different
    # pick must be a near-tie of the reference's scores.
    u = hash_uniform_ref(seeds, offsets, V)
    score = z.float() - torch.log(-torch.log(u))
    best = score.max(dim=-1).values
    chosen = score.gather(1, got.unsqueeze(1)).squeeze(1)
    assert torch.all(best - chosen <= 1e-4 * best.abs().clamp(min=1)), (got, score.argmax(-1))
    assert int(got[0]) >= V // 2  # never a masked entry


@requires_triton
@pytest.mark.parametrize("S,V,block,min_chunk,target", [(1, 1000, 64, 64, 512), (3, 1000, 32, 64, 8),
                                                        (4, 515, 16, 16, 64)],
                         ids=["b1-16-chunks", "b3-3-chunks", "b4-ragged-last-chunk"])
def test_split_rows_draw_what_one_program_per_row_draws(S, V, block, min_chunk, target):
    """Rows cut into chunks (one program each, then a reduce launch) pick exactly the token one program
    streaming the whole row picks: the best score, the lowest index holding it; a row of all -inf gives 0."""
    from gyrfalcon.kernels.argmax import split_rows

    assert split_rows(S, V, block, min_chunk, target)[1] > 1  # the two-launch path
    g = torch.Generator().manual_seed(V + S)
    z = (torch.randn(S, V, generator=g) * 3).to(DEVICE)
    z[0, : V // 2] = float("-inf")
    if S > 1:
        z[-1] = float("-inf")  # every entry masked
    seeds = torch.randint(0, 2**62, (S,), generator=g).to(DEVICE)
    offsets = torch.randint(0, 2**40, (S,), generator=g).to(DEVICE)
    whole = gumbel_argmax_triton(z, seeds, offsets, block=block, min_chunk=10**9)  # one chunk per row
    split = gumbel_argmax_triton(z, seeds, offsets, block=block, min_chunk=min_chunk, target_programs=target)
    assert torch.equal(split, whole)
    assert int(split[0]) >= V // 2  # never a masked entry
    live = S if S == 1 else S - 1
    if S > 1:
        assert int(split[-1]) == 0
    # and the reference's choice, up to near-ties of the scores (see above)
    u = hash_uniform_ref(seeds[:live], offsets[:live], V)
    score = z[:live].float() - torch.log(-torch.log(u))
    chosen = score.gather(1, split[:live].unsqueeze(1)).squeeze(1)
    best = score.max(dim=-1).values
    assert torch.all(best - chosen <= 1e-4 * best.abs().clamp(min=1))


def test_dispatch_falls_back_to_the_reference_when_the_kernel_fails(monkeypatch):
    import gyrfalcon.kernels.sampling as sampling

    def broken(*a, **k):
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(sampling, "use_triton", lambda t: True)
    monkeypatch.setattr(sampling, "gumbel_argmax_triton", broken)
    monkeypatch.setattr(sampling, "_TRITON_FAILED", False)
    z = torch.randn(2, 30)
    s, o = torch.tensor([1, 2]), torch.tensor([0, 0])
    assert torch.equal(sampling.gumbel_argmax(z, s, o), gumbel_argmax_ref(z, s, o))
    assert sampling._TRITON_FAILED
