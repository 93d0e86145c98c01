"""Expert parallelism at the layer: the two ranks' SparseMoE blocks built in one process (the ParallelState set by
hand, as test_parallel_state.py does; the block's all-reduce replaced by the identity, so each rank's call returns
its partial), each rank holding 4 of the 8 experts whole.

What is checked: every rank routes every token the same way; each rank's fused-MoE op gets only its experts'
weights and runs only the (token, expert) pairs routed to them (the rows of the sort its grouped GEMMs follow:
about T * k / 2, together every pair once); the ranks' partials, shared expert included, sum to the one-process
block's output, so the shared expert is added exactly once. Qwen3-Next's block (softmax routing, a gated shared
expert) and DeepSeek-V3's (grouped sigmoid routing, shared experts); FP8 experts load their block scales by local
index. The two-process engines of test_tensor_parallel.py's -ep configs check the same end to end (tokens and
distributions)."""

from __future__ import annotations

import pytest
import torch

import gyrfalcon.layers.moe as moe_mod
from gyrfalcon.distributed import parallel_state
from gyrfalcon.kernels.fused_moe import moe_align
from gyrfalcon.kernels.moe_router import SIGMOID
from gyrfalcon.layers.moe import FusedExperts, SparseMoE
from gyrfalcon.layers.norm import RMSNorm

E, K, H, I, SI, T = 8, 2, 16, 12, 20, 24  # noqa: E741
VARIANTS = {
    "qwen3-next": dict(shared_intermediate_size=SI, shared_gate=True),
    "deepseek-v3": dict(shared_intermediate_size=SI, shared_name="shared_experts", scoring=SIGMOID, use_bias=True,
                        n_group=4, topk_group=2, routed_scaling_factor=2.5, logits_fp32=True),
}


@pytest.fixture
def as_rank(monkeypatch):
    def set_rank(rank, world, ep=False):
        monkeypatch.setattr(parallel_state, "_STATE", parallel_state.ParallelState(rank, world, ep))
    return set_rank


def _checkpoint(seed):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    return {"gate": r(E, H), "bias": r(E, scale=0.1), "norm": 1 + r(H, scale=0.1),
            "experts": [(r(I, H, scale=H ** -0.5), r(I, H, scale=H ** -0.5), r(H, I, scale=I ** -0.5))
                        for _ in range(E)],
            "shared": (r(SI, H, scale=H ** -0.5), r(SI, H, scale=H ** -0.5), r(H, SI, scale=SI ** -0.5)),
            "shared_gate": r(1, H, scale=H ** -0.5)}


def _block(variant, ckpt):
    """SparseMoE as the current rank builds it, loaded through its weight loaders (each narrows to its shard)."""
    moe = SparseMoE(H, E, K, I, **VARIANTS[variant])
    moe.gate.weight.data.copy_(ckpt["gate"])
    if moe.gate.e_score_correction_bias is not None:
        moe.gate.e_score_correction_bias.data.copy_(ckpt["bias"])
    ex = moe.experts
    for e, (gp, up, down) in enumerate(ckpt["experts"]):
        ex.weight_loader(ex.w13, gp, (e, 0))
        ex.weight_loader(ex.w13, up, (e, 1))
        ex.weight_loader(ex.w2, down, (e, None))
    sh = getattr(moe, moe.shared_name)
    sh.gate_up_proj.weight_loader(sh.gate_up_proj.weight, ckpt["shared"][0], 0)
    sh.gate_up_proj.weight_loader(sh.gate_up_proj.weight, ckpt["shared"][1], 1)
    sh.down_proj.weight_loader(sh.down_proj.weight, ckpt["shared"][2])
    if moe.shared_expert_gate is not None:
        moe.shared_expert_gate.weight_loader(moe.shared_expert_gate.weight, ckpt["shared_gate"])
    norm = RMSNorm(H)
    norm.weight.data.copy_(ckpt["norm"])
    moe.bind_input_norm(norm)
    return moe


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_rank_runs_only_its_experts_and_partials_sum_to_the_block(variant, as_rank, monkeypatch):
    ckpt = _checkpoint(seed=len(variant))
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1))
    calls = []
    real = moe_mod.fused_moe

    def recording(x_, w13, w2, tw, ids, *args, **kwargs):
        calls.append((w13.shape[0], kwargs.get("expert_start", 0), ids.clone()))
        return real(x_, w13, w2, tw, ids, *args, **kwargs)

    monkeypatch.setattr(moe_mod, "fused_moe", recording)
    monkeypatch.setattr(moe_mod, "tp_all_reduce", lambda t: t)  # each rank's call returns its partial

    whole_block = _block(variant, ckpt)
    whole = whole_block(x, None)[0]
    shared = getattr(whole_block, whole_block.shared_name)(whole_block.norm_in(x, None).y)
    parts = []
    for r in range(2):
        as_rank(r, 2, ep=True)
        parts.append(_block(variant, ckpt)(x, None)[0])
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=1e-5, atol=1e-5)
    # the shared expert matters here (counting it twice, or not at all, would be far outside the tolerance)
    assert shared.abs().max() > 100 * 1e-5 * (1 + whole.abs().max())

    (n0, s0, ids), *ranks = calls
    assert (n0, s0) == (E, 0)
    P, seen = T * K, 0
    for r, (n, start, rank_ids) in enumerate(ranks):
        assert (n, start) == (E // 2, r * E // 2)
        assert torch.equal(rank_ids, ids)  # the replicated router: the same routing on every rank
        # The rows this rank's grouped GEMMs run: its sort keeps its own pairs only.
        sorted_ids, _ = moe_align(rank_ids, n, 16, one_launch=False, expert_start=start)
        rows = int((sorted_ids < P).sum())
        assert rows == int(((ids >= start) & (ids < start + n)).sum())
        assert 0 < rows < P
        seen += rows
    assert seen == P


def test_remote_tokens_add_nothing_on_a_rank(as_rank, monkeypatch):
    """A token whose experts are all on rank 1 leaves rank 0's routed-expert output at exactly 0, even with NaN in
    its input: rank 0 never computes it (the first expert parallelism computed it as a local expert with weight 0,
    and 0 * NaN is NaN)."""
    as_rank(0, 2, ep=True)
    ex = FusedExperts(E, H, I)
    ckpt = _checkpoint(seed=3)
    for e, (gp, up, down) in enumerate(ckpt["experts"]):
        ex.weight_loader(ex.w13, gp, (e, 0))
        ex.weight_loader(ex.w13, up, (e, 1))
        ex.weight_loader(ex.w2, down, (e, None))
    x = torch.randn(3, H)
    x[0] = float("nan")
    ids = torch.tensor([[5, 6], [1, 7], [0, 3]])
    tw = torch.full((3, 2), 0.5)
    out = ex(x, tw, ids)
    assert torch.isfinite(out).all() and not out[0].any() and out[1].any() and out[2].any()


def test_fp8_expert_scales_load_by_local_index(as_rank):
    """FP8 experts under expert parallelism: rank 1 of 2 keeps experts 4-7's e4m3 weights and their block scales,
    the scales at the local index (a checkpoint names them by global expert)."""
    from gyrfalcon.layers.quantization.fp8 import FP8_DTYPE, fp8_scope

    as_rank(1, 2, ep=True)
    h, i, block = 32, 128, (128, 128)
    with fp8_scope(block):
        ex = FusedExperts(E, h, i)
    assert ex.quant_block == block and ex.w13.shape == (E // 2, 2 * i, h)
    for e in range(E):
        for half in (0, 1):
            ex.weight_loader(ex.w13, torch.full((i, h), float(e)).to(FP8_DTYPE), (e, half))
            ex.weight_loader(ex.w13_weight_scale_inv, torch.full((1, 1), 10.0 * e + half), (e, half))
        ex.weight_loader(ex.w2, torch.full((h, i), float(e)).to(FP8_DTYPE), (e, None))
        ex.weight_loader(ex.w2_weight_scale_inv, torch.full((1, 1), 10.0 * e + 5), (e, None))
    for local in range(E // 2):
        e = E // 2 + local
        assert (ex.w13[local].float() == e).all() and (ex.w2[local].float() == e).all()
        assert ex.w13_weight_scale_inv[local].reshape(-1).tolist() == [10.0 * e, 10.0 * e + 1]
        assert ex.w2_weight_scale_inv[local].reshape(-1).tolist() == [10.0 * e + 5]
