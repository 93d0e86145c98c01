"""MLA prefill at DeepSeek-V3's real attention dims on the GPU (kv_lora_rank 512, nope 128, rope 64, v 128; 16 of the
128 heads to keep it small): the expanded form (layers/mla_expanded.py: context rows gathered from the paged latent
cache, kv_b_proj, the Triton expanded kernel, rounds merged by lse) against the absorbed form (the tiled prefill
kernel, then W_UV) in bf16, both against an fp32 reference. A ragged step: a fresh 1,000-token prompt and a
300-token chunk over a 1,500-token cached prefix, in one round and in several.
Run through scripts/gpu/test.sh or `pytest tests/gpu/test_mla_prefill_gpu.py`."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import gyrfalcon.layers.mla_expanded as mla_expanded  # noqa: E402
from gyrfalcon.kernels.mla_attention import mla_attention_ref, mla_prefill_tiled_triton  # noqa: E402
from gyrfalcon.layers.linear import Linear  # noqa: E402
from gyrfalcon.runner.forward_batch import ForwardBatch  # noqa: E402

H, L, NOPE, R, V, BS = 16, 512, 128, 64, 128, 64
SEQS = [(1000, 0), (300, 1500)]  # (query tokens, cached prefix)


def _step(dtype):
    """(ForwardBatch, cache [NB, BS, 1, L + R] in shuffled blocks, q_nope, q_rope, kv_b_proj, scale)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    dev = torch.device("cuda")
    n_blocks = [-(-(q + p) // BS) for q, p in SEQS]
    perm = torch.randperm(sum(n_blocks) + 4, generator=torch.Generator().manual_seed(0)).tolist()
    cache = torch.randn(len(perm), BS, 1, L + R, device=dev, generator=g).to(dtype)
    bt = torch.zeros(len(SEQS), max(n_blocks), dtype=torch.int32)
    for i, n in enumerate(n_blocks):
        bt[i, :n] = torch.tensor([perm.pop() for _ in range(n)])
    T = sum(q for q, _ in SEQS)
    qsl = torch.tensor([0, SEQS[0][0], T], dtype=torch.int32, device=dev)
    seq_lens = torch.tensor([q + p for q, p in SEQS], dtype=torch.int32, device=dev)
    fb = ForwardBatch(input_ids=torch.zeros(T, dtype=torch.int64, device=dev), positions=None, slot_mapping=None,
                      query_start_loc=qsl, seq_lens=seq_lens, block_tables=bt.to(dev), logits_indices=None,
                      is_decode=False, max_query_len=SEQS[0][0], max_seq_len=int(seq_lens.max()),
                      num_seqs=len(SEQS))
    kv_b = Linear(L, H * (NOPE + V)).to(dev)
    kv_b.weight.copy_(torch.randn(H * (NOPE + V), L, device=dev, generator=g) / L ** 0.5)
    kv_b = kv_b.to(dtype)
    q_nope = torch.randn(T, H, NOPE, device=dev, generator=g).to(dtype)
    q_rope = torch.randn(T, H, R, device=dev, generator=g).to(dtype)
    return fb, cache, q_nope, q_rope, kv_b, (NOPE + R) ** -0.5 * 1.3


def _absorbed(fb, cache, q_nope, q_rope, kv_b, scale, tiled):
    """The absorbed form: q_abs = [q_nope W_UK | q_rope], MQA over the latent rows, then W_UV -> [T, H * V]."""
    w = kv_b.weight.view(H, NOPE + V, L)
    q_abs = torch.cat([torch.einsum("thn,hnl->thl", q_nope, w[:, :NOPE]), q_rope], dim=-1)
    attend = mla_prefill_tiled_triton if tiled else mla_attention_ref
    o_lat = attend(q_abs, cache, fb.block_tables, fb.seq_lens, fb.query_start_loc, scale, L)
    return torch.einsum("thl,hvl->thv", o_lat, w[:, NOPE:]).reshape(q_nope.shape[0], H * V)


@pytest.mark.parametrize("rounds", ["one", "several"])
def test_expanded_equals_absorbed_bf16(monkeypatch, rounds):
    # 2,800 context rows: one round under a 4,096-row floor; rounds of T = 1,300 rows (floor 1): 3
    monkeypatch.setattr(mla_expanded, "MIN_WORKSPACE_ROWS", 4096 if rounds == "one" else 1)
    fb, cache, q_nope, q_rope, kv_b, scale = _step(torch.bfloat16)
    plan = mla_expanded.ExpandedPrefillPlan.for_batch(fb)
    assert len(plan.rounds(fb.block_tables, BS)) == (1 if rounds == "one" else 3)
    got = mla_expanded.attend_expanded(plan, q_nope, q_rope, cache, fb, kv_b, H, L, V, scale)
    absorbed = _absorbed(fb, cache, q_nope, q_rope, kv_b, scale, tiled=True)
    f32 = [t.float() for t in (cache, q_nope, q_rope)]
    kv_b32 = Linear(L, H * (NOPE + V)).cuda()
    kv_b32.weight.copy_(kv_b.weight.float())
    want = _absorbed(fb, f32[0], f32[1], f32[2], kv_b32, scale, tiled=False)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got.float(), absorbed.float(), atol=3e-2, rtol=3e-2)

