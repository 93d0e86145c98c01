import pytest
import torch
import torch.nn.functional as F

from gyrfalcon.kernels.embedding import embedding_with_pending_ref, embedding_with_pending_triton
from kernels_testutil import DEVICE, DTYPES, requires_triton


def _case(T, V, H, S, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(V, H, generator=g).to(dtype).to(DEVICE)
    ids = torch.randint(0, V, (T,), generator=g).to(DEVICE)
    last = torch.randint(0, V, (S,), generator=g).to(DEVICE)
    # About half the tokens are pending: each takes some row of last_sampled.
    src = torch.where(torch.rand(T, generator=g) < 0.5, torch.randint(0, S, (T,), generator=g),
                      torch.full((T,), -1)).to(DEVICE)
    return weight, ids, src, last


def test_ref_takes_pending_tokens_from_last_sampled():
    weight = torch.arange(12.0).view(6, 2)
    ids = torch.tensor([1, 0, 5, 0])
    src = torch.tensor([-1, 2, -1, 0])
    last = torch.tensor([3, 4, 2])
    got = embedding_with_pending_ref(weight, ids, src, last)
    assert got.tolist() == [[2.0, 3.0], [4.0, 5.0], [10.0, 11.0], [6.0, 7.0]]  # tokens 1, 2, 5, 3


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,V,H,S", [(1, 50, 64, 1), (7, 300, 100, 5), (16, 1000, 1100, 16), (3, 40, 2048, 8)])
def test_triton_matches_ref(dtype, T, V, H, S):
    weight, ids, src, last = _case(T, V, H, S, dtype)
    got = embedding_with_pending_triton(weight, ids, src, last)
    want = embedding_with_pending_ref(weight, ids, src, last)
    assert got.dtype == dtype and got.shape == (T, H)
    assert torch.equal(got, want)  # a copy: bit-exact


@requires_triton
def test_triton_no_pending_is_plain_embedding():
    weight, ids, _, last = _case(9, 77, 96, 4, torch.float32, seed=3)
    src = torch.full_like(ids, -1)
    assert torch.equal(embedding_with_pending_triton(weight, ids, src, last), F.embedding(ids, weight))


@requires_triton
def test_triton_empty():
    weight, ids, src, last = _case(0, 10, 32, 2, torch.float32)
    assert embedding_with_pending_triton(weight, ids, src, last).shape == (0, 32)
