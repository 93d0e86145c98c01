"""The shard arithmetic the layers do at build time, for ranks of a larger group (the state is set by hand: no
process group is needed to size a shard), and the collectives' identity at world size 1."""

from __future__ import annotations

import pytest
import torch

from gyrfalcon.distributed import parallel_state
from gyrfalcon.distributed import shard_size, tp_all_gather, tp_all_reduce
from gyrfalcon.layers.embedding import VocabEmbedding
from gyrfalcon.layers.linear import QKVLinear, RowParallelLinear, qkv_head_split


@pytest.fixture
def as_rank(monkeypatch):
    def set_rank(rank, world, ep=False):
        monkeypatch.setattr(parallel_state, "_STATE", parallel_state.ParallelState(rank, world, ep))
    return set_rank


def test_world_size_one_is_the_identity():
    x = torch.randn(3, 5)
    assert tp_all_reduce(x) is x and tp_all_gather(x) is x
    assert shard_size(12, "x") == 12


@pytest.mark.parametrize("world,kv,want", [
    (4, 8, [(8, 2, 0), (8, 2, 1), (8, 2, 2), (8, 2, 3)]),  # K/V heads split
    (4, 2, [(8, 1, 0), (8, 1, 0), (8, 1, 1), (8, 1, 1)]),  # each K/V head on two ranks
    (4, 1, [(8, 1, 0)] * 4),  # one K/V head everywhere
])
def test_qkv_head_split(as_rank, world, kv, want):
    got = []
    for r in range(world):
        as_rank(r, world)
        got.append(qkv_head_split(32, kv))
    assert got == want


def test_uneven_splits_are_refused(as_rank):
    as_rank(0, 4)
    with pytest.raises(ValueError, match="does not divide num_attention_heads"):
        qkv_head_split(6, 2)
    with pytest.raises(ValueError, match="multiple of it"):
        as_rank(0, 4)
        qkv_head_split(12, 3)
    with pytest.raises(ValueError, match="row-parallel"):
        RowParallelLinear(6, 4)


def test_rank_loads_its_rows(as_rank):
    """Rank 1 of 2 with one K/V head: its two query heads' rows, the whole K/V head; o_proj's input columns of
    those heads; the vocabulary's second half (padded past the vocabulary with zeros)."""
    head_dim, hidden = 2, 4
    q, k, v = (torch.arange(n * head_dim * hidden, dtype=torch.float32).view(n * head_dim, hidden) + off
               for n, off in ((4, 0.0), (1, 1000.0), (1, 2000.0)))
    as_rank(1, 2)
    qkv = QKVLinear(hidden, head_dim, 4, 1)
    for sid, t in (("q", q), ("k", k), ("v", v)):
        qkv.weight_loader(qkv.weight, t, sid)
    assert torch.equal(qkv.weight, torch.cat([q[4:8], k, v]))
    o = RowParallelLinear(8, hidden)
    full = torch.randn(hidden, 8)
    o.weight_loader(o.weight, full)
    assert torch.equal(o.weight, full[:, 4:])
    emb = VocabEmbedding(7, 3)
    table = torch.randn(7, 3)
    emb.weight_loader(emb.weight, table)
    assert torch.equal(emb.weight[:3], table[4:]) and not emb.weight[3].any()


def test_checkpoint_slice_reads_the_part_asked_for(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from gyrfalcon.distributed import CheckpointSlice, as_tensor

    t = torch.randn(6, 4, dtype=torch.bfloat16)
    save_file({"w": t}, str(tmp_path / "a.safetensors"))
    with safe_open(str(tmp_path / "a.safetensors"), framework="pt") as sf:
        s = CheckpointSlice(sf.get_slice("w"))
        assert s.shape == t.shape and s.dtype == torch.bfloat16 and s.dim() == 2
        assert torch.equal(s.narrow(0, 2, 3), t[2:5]) and torch.equal(s.narrow(1, 1, 2), t[:, 1:3])
        assert torch.equal(as_tensor(s), t) and as_tensor(t) is t
        with pytest.raises(ValueError, match="outside"):
            s.narrow(0, 4, 3)
    p = torch.randn(3, 6, 4)  # a packed [E, 2I, H] experts tensor: one expert's up rows, narrowed again
    save_file({"p": p}, str(tmp_path / "b.safetensors"))
    with safe_open(str(tmp_path / "b.safetensors"), framework="pt") as sf:
        up = CheckpointSlice(sf.get_slice("p")).pick(1, 3, 3)
        assert up.shape == (3, 4) and torch.equal(as_tensor(up), p[1, 3:])
        assert torch.equal(up.narrow(0, 1, 2), p[1, 4:6]) and torch.equal(up.narrow(1, 2, 2), p[1, 3:, 2:])
        with pytest.raises(ValueError, match="outside"):
            CheckpointSlice(sf.get_slice("p")).pick(3)


def test_cli_flags_reach_the_engine_arguments():
    import argparse

    from gyrfalcon.cli import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    keys = ("tensor_parallel_size", "enable_expert_parallel", "distributed_executor_backend")
    kw = engine_kwargs(p.parse_args(["-tp", "4", "--enable-expert-parallel", "--distributed-executor-backend", "mp"]))
    assert tuple(kw[k] for k in keys) == (4, True, "mp")
    kw = engine_kwargs(p.parse_args([]))
    assert tuple(kw[k] for k in keys) == (1, False, None)


def test_a_worker_startup_error_keeps_its_kind():
    """Bad settings a worker meets (a dimension the tensor-parallel size does not divide) stay ValueErrors, which
    the server reports as such; anything else is a RuntimeError. (The text is the worker's own message.)"""
    from gyrfalcon.engine.executor_mp import WorkerDied, startup_error

    bad = startup_error(WorkerDied("rank 1 failed: ValueError: tensor_parallel_size 4 does not divide", "ValueError"))
    assert type(bad) is ValueError and "does not divide" in str(bad)
    assert type(startup_error(WorkerDied("rank 0 exited with code -9"))) is RuntimeError


def test_mla_rank_holds_its_heads(as_rank):
    """DeepSeek MLA at rank 1 of 2 (4 heads, a V3.2 indexer): q_b_proj's and kv_b_proj's rows of heads 2-3, o_proj's
    columns of them; fused_qkv_a_proj (q_a | wk | kv_a) and the indexer's wq_b whole (replicated)."""
    from gyrfalcon.layers.mla import MultiHeadLatentAttention
    from gyrfalcon.layers.rotary import RotaryEmbedding

    as_rank(1, 2)
    H, qlr, L, nope, rope, v, hidden = 4, 12, 16, 4, 2, 6, 8
    rot = RotaryEmbedding(rope, rope, 32, None, 32)
    mla = MultiHeadLatentAttention(hidden, H, qlr, L, nope, rope, v, 0, rot, 1.0, index=(2, 4, 4))
    assert mla.num_heads == 2
    ckpt = {"q": torch.randn(qlr, hidden), "wk": torch.randn(4, hidden), "kv_a": torch.randn(L + rope, hidden),
            "wq_b": torch.randn(2 * 4, qlr), "q_b": torch.randn(H * (nope + rope), qlr)}
    for sid in ("q", "wk", "kv_a"):
        mla.fused_qkv_a_proj.weight_loader(mla.fused_qkv_a_proj.weight, ckpt[sid], sid)
    for sid in ("wq_b", "q_b"):
        mla.fused_q_b_proj.weight_loader(mla.fused_q_b_proj.weight, ckpt[sid], sid)
    kv_b, o = torch.randn(H * (nope + v), L), torch.randn(hidden, H * v)
    mla.kv_b_proj.weight_loader(mla.kv_b_proj.weight, kv_b)
    mla.o_proj.weight_loader(mla.o_proj.weight, o)
    assert torch.equal(mla.fused_qkv_a_proj.weight, torch.cat([ckpt["q"], ckpt["wk"], ckpt["kv_a"]]))
    assert torch.equal(mla.fused_q_b_proj.weight, torch.cat([ckpt["wq_b"], ckpt["q_b"][2 * (nope + rope):]]))
    assert torch.equal(mla.kv_b_proj.weight, kv_b[2 * (nope + v):]) and torch.equal(mla.o_proj.weight, o[:, 2 * v:])
    w_uk, w_uv = mla.absorbed_weights(torch.float32)
    assert w_uk.shape == (2, nope, L) and w_uv.shape == (2, v, L)


def test_shard_skeleton_is_rank_zeros_shard_on_meta(qwen3_ckpt):
    """What `bench latency` / `throughput` read of a tensor-parallel engine's model (MultiprocExecutor.model): rank
    0's shard built on the meta device, the process's own state untouched."""
    from gyrfalcon.config import EngineConfig
    from gyrfalcon.distributed import get_state
    from gyrfalcon.engine.executor_mp import shard_skeleton

    one = shard_skeleton(EngineConfig.create(str(qwen3_ckpt), device="cpu"), 0)
    two = shard_skeleton(EngineConfig.create(str(qwen3_ckpt), device="cpu", tensor_parallel_size=2), 0)
    assert get_state().world_size == 1
    assert all(p.is_meta for p in two.parameters())
    attn1, attn2 = one.model.layers[0].self_attn, two.model.layers[0].self_attn
    assert attn2.num_heads * 2 == attn1.num_heads
    assert two.model.layers[0].mlp.down_proj.weight.shape[1] * 2 == one.model.layers[0].mlp.down_proj.weight.shape[1]
