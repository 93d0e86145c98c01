"""Hybrid models' prefix caching on the engine side, without a model: the SnapshotPool's bookkeeping (pending saves,
LRU eviction) and the scheduler's use of it (in-step saves at the wanted block boundaries with no chunk cut, saves and
restores in the plain-data batch, hits only where both the KV blocks and a snapshot exist, slots freed on abort and
preemption)."""

from __future__ import annotations

import random

import pytest

from gyrfalcon.engine.block_manager import BlockManager
from gyrfalcon.engine.request import Request
from gyrfalcon.engine.scheduler import Scheduler
from gyrfalcon.engine.snapshot_pool import SnapshotPool
from gyrfalcon.engine.state_manager import StateManager
from gyrfalcon.sampling_params import SamplingParams
from gyrfalcon.step_io import decode_batch, encode_batch

BS = 4


def test_pool_pending_lru_and_eviction():
    pool = SnapshotPool(2, stride=1)
    a = pool.reserve(b"a")
    b = pool.reserve(b"b")
    assert {a, b} == {0, 1} and pool.contains(b"a") and pool.contains(b"b")
    # Saved by the step being scheduled: not restorable, and not evictable either (no id left this step).
    assert pool.lookup(b"a") is None and pool.reserve(b"c") is None and pool.num_available == 0
    pool.begin_step()
    assert pool.lookup(b"a") == a and pool.lookup(b"b") == b
    pool.touch(b"a")  # a restore: "b" becomes the least recently used
    c = pool.reserve(b"c")
    assert c == b and pool.num_evictions == 1 and not pool.contains(b"b") and pool.lookup(b"a") == a
    pool.begin_step()
    assert pool.num_cached == 2 and pool.num_saves == 3 and pool.num_restores == 1
    pool.reset()
    assert pool.num_cached == 0 and pool.lookup(b"a") is None
    with pytest.raises(ValueError):
        SnapshotPool(0, 1)
    with pytest.raises(ValueError):
        SnapshotPool(4, 0)


def make(num_snapshots=64, stride=1, num_blocks=64, slots=4, budget=64, caching=True):
    bm = BlockManager(num_blocks, BS, caching)
    sm = StateManager(slots)
    s = Scheduler(bm, 8, budget, state_manager=sm, snapshots=SnapshotPool(num_snapshots, stride))
    return s, bm, sm


def run_step(s):
    batch = s.schedule()
    sampled = [[(hash(r.request_id) + r.num_tokens) % 1000] if sr.sample else []
               for sr, r in zip(batch.reqs, batch.requests)]
    s.update(batch, sampled)
    return batch


def run_all(s):
    batches = []
    while s.has_unfinished_requests():
        batches.append(run_step(s))
    return batches


def req(rid, tokens, max_tokens=2, **kw):
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw))


BASE = [(7 * i) % 100 + 1 for i in range(40)]


def chunks(batches, rid):
    return [(sr.start, sr.num_new_tokens) for b in batches for sr in b.reqs if sr.request_id == rid and
            sr.start < 1000]


def test_prompt_runs_in_one_step_with_its_saves_inside():
    """stride 2 blocks of 4 tokens, a 21-token prompt: snapshots after blocks 2 and 4 (the stride) and 5 (the prompt's
    last boundary a hit can use), all asked of the one step that runs the whole prompt (no chunk cut for them)."""
    s, bm, sm = make(stride=2)
    s.add_request(req("a", BASE[:21]))
    batches = run_all(s)
    assert chunks(batches, "a")[:2] == [(0, 21), (21, 1)]
    saves = batches[0].state_saves
    assert [(row, pos) for row, pos, _ in saves] == [(0, 8), (0, 16), (0, 20)]
    assert len({sid for _, _, sid in saves}) == 3
    assert not any(b.state_saves for b in batches[1:]) and not any(b.state_restores for b in batches)
    # The runner can live in another process: the saves survive the codec.
    again = decode_batch(encode_batch(batches[0]))
    assert again.state_saves == saves and again.state_restores == []
    assert sm.num_free_slots == 4 and bm.num_free_blocks == bm.num_blocks


def test_budget_cut_chunks_save_the_boundaries_they_cross():
    """Chunks cut by the token budget (7 tokens) at no boundary: each asks for the boundaries inside it, on the row
    it occupies in a batch shared with another request's chunks."""
    s, bm, _ = make(stride=1, budget=7)
    s.add_request(req("x", [200 + i for i in range(3)]))
    s.add_request(req("a", BASE[:18]))
    batches = run_all(s)
    rows = {}
    for b in batches:
        for row, pos, _ in b.state_saves:
            sr = b.reqs[row]
            assert sr.request_id == "a" and sr.start < pos <= sr.start + sr.num_new_tokens
            rows.setdefault(pos, (sr.start, sr.num_new_tokens))
    assert rows == {4: (0, 4), 8: (4, 6), 12: (10, 7), 16: (10, 7)}


@pytest.mark.parametrize("shared_blocks", [1, 2, 3, 5])
def test_hit_restores_the_longest_snapshotted_prefix(shared_blocks):
    """A second request sharing `shared_blocks` blocks with the first resumes at the last of them (stride 1: every
    boundary has a snapshot): the restore names the snapshot saved there and the slot the request got; the prefix
    statistics count those tokens as for a dense model."""
    s, bm, sm = make(stride=1)
    s.add_request(req("a", BASE[:24]))
    first = run_all(s)
    saved = {}  # boundary (tokens) -> snapshot id
    for b in first:
        for _, pos, sid in b.state_saves:
            saved[pos] = sid
    assert sorted(saved) == [4, 8, 12, 16, 20]  # (24 - 1) // 4 = 5 boundaries
    n = shared_blocks * BS
    s.add_request(req("b", BASE[:n] + [200 + i for i in range(7)]))
    b = run_step(s)
    assert b.reqs[0].start == n and b.requests[0].num_cached_tokens == n
    assert b.state_restores == [(saved[n], b.reqs[0].new_request.state_slots["state"])]
    assert bm.prefix_hits == n and bm.prefix_queries == 24 + n + 7
    run_all(s)
    assert sm.num_free_slots == 4 and bm.num_free_blocks == bm.num_blocks


def test_stride_limits_hits_to_snapshotted_boundaries():
    """stride 3: a request sharing 5 blocks resumes at block 3 (the last snapshot inside the shared prefix), not 5,
    though all 5 KV blocks are cached."""
    s, bm, _ = make(stride=3)
    s.add_request(req("a", BASE[:30]))
    run_all(s)
    s.add_request(req("b", BASE[:20] + [300, 301, 302]))
    assert len(bm.get_computed_blocks(s.waiting[0])) == 5
    b = run_step(s)
    assert b.reqs[0].start == 12 and len(b.state_restores) == 1


def test_no_hit_without_a_snapshot_and_none_in_the_saving_step():
    """A request admitted in the step that saves a snapshot cannot restore it (the copy happens after that step's
    forward): it starts from scratch. Without prefix caching nothing is saved or restored."""
    s, bm, _ = make(stride=2)
    s.add_request(req("a", BASE[:9]))
    s.add_request(req("b", BASE[:9]))
    b = run_step(s)
    # Both want the boundary after 8 tokens; the second finds it pending: no save, no restore.
    assert [(sr.request_id, sr.start, sr.num_new_tokens) for sr in b.reqs] == [("a", 0, 9), ("b", 0, 9)]
    assert [(row, pos) for row, pos, _ in b.state_saves] == [(0, 8)] and not b.state_restores
    run_all(s)
    s.add_request(req("c", BASE[:9]))
    b = run_step(s)
    assert b.reqs[0].start == 8 and len(b.state_restores) == 1
    run_all(s)
    s2, bm2, _ = make(caching=False)
    assert s2.snapshots is None
    s2.add_request(req("a", BASE[:9]))
    assert not any(b.state_saves or b.state_restores for b in run_all(s2))


def test_tiny_pool_evicts_least_recent_and_hits_fall_back():
    """Two snapshots for prompts that want more: a step keeps the deepest boundaries it can, later saves evict the
    least recently used, a later request hits the longest prefix whose snapshot survived (or none), never an evicted
    one."""
    s, bm, _ = make(num_snapshots=2, stride=1)
    s.add_request(req("a", BASE[:17]))  # boundaries 4, 8, 12, 16 in one step: the pool takes the last two
    b = run_step(s)
    assert [pos for _, pos, _ in b.state_saves] == [12, 16]
    run_all(s)
    assert s.snapshots.num_evictions == 0 and s.snapshots.num_cached == 2
    s.add_request(req("b", BASE[:10] + [250, 251, 252]))  # shares 2 blocks: no snapshot of them
    b = run_step(s)
    assert b.reqs[0].start == 0 and not b.state_restores
    # b wants 4, 8 and its own 12; the pool gives it the deepest two, evicting a's 12 and 16.
    assert [pos for _, pos, _ in b.state_saves] == [8, 12]
    run_all(s)
    # c shares 3 cached KV blocks with a, but only the boundary after 8 tokens has a snapshot (b's).
    s.add_request(req("c", BASE[:14] + [260]))
    assert len(bm.get_computed_blocks(s.waiting[0])) == 3 and s.snapshots.num_evictions == 2
    b = run_step(s)
    assert b.reqs[0].start == 8
    h = bm.prefix_hash(b.requests[0], 2)
    assert b.state_restores == [(s.snapshots.lookup(h), b.reqs[0].new_request.state_slots["state"])]


def test_abort_and_preemption_free_slots_and_keep_snapshots():
    """Aborting mid-prefill frees the slot (its saved snapshots stay: they are cache entries, valid for the prefix);
    a preempted request comes back through its own snapshots."""
    s, bm, sm = make(stride=1, num_blocks=64, slots=2, budget=6)
    s.add_request(req("a", BASE[:20], max_tokens=3))
    b1, b2 = run_step(s), run_step(s)  # tokens 0..5 and 6..11
    assert [pos for b in (b1, b2) for _, pos, _ in b.state_saves] == [4, 8, 12]
    assert sm.num_free_slots == 1
    s.finish_request("a")
    assert sm.num_free_slots == 2
    run_step(s)  # the step the abort is reported in makes the saves restorable
    s.add_request(req("b", BASE[:20]))
    b = run_step(s)
    assert b.reqs[0].start == 12 and len(b.state_restores) == 1  # the deepest boundary a saved
    assert [pos for _, pos, _ in b.state_saves] == [16]
    # Preemption: b loses its slot and blocks, and on re-admission restores the deepest boundary it saved itself.
    run_step(s)
    victim = s.running[-1]
    s.running.pop()
    s._preempt(victim)
    assert victim.state_slot is None and sm.num_free_slots == 2
    b = run_step(s)
    sr = [r for r in b.reqs if r.request_id == "b"][0]
    assert sr.start == 16 and sr.new_request is not None and len(b.state_restores) == 1
    run_all(s)
    assert sm.num_free_slots == 2 and bm.num_free_blocks == bm.num_blocks


def test_stride_flag_and_default_from_memory():
    """--linear-state-snapshot-stride reaches the cache config (at least 1 block); unset, the stride is the blocks
    whose KV bytes equal one snapshot's (CachePlan.snapshot_stride), and the snapshots get their share of the
    memory, never more of them than blocks."""
    import argparse

    from gyrfalcon.cache_spec import FullAttentionSpec, LinearStateSpec
    from gyrfalcon.cli import add_engine_args, engine_kwargs
    from gyrfalcon.config import CacheConfig
    from gyrfalcon.runner.kv_cache import SNAPSHOT_MEMORY_SHARE, CachePlan

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs(p.parse_args(["--linear-state-snapshot-stride", "3"]))["linear_state_snapshot_stride"] == 3
    assert engine_kwargs(p.parse_args([]))["linear_state_snapshot_stride"] is None
    with pytest.raises(ValueError, match="linear_state_snapshot_stride"):
        CacheConfig(linear_state_snapshot_stride=0).verify()
    # Qwen3.5-397B-A17B's shapes: 45 GDN layers of 64 value / 16 key heads of 128, 15 attention layers of 2 KV heads
    # of 256, bf16 KV and conv, fp32 recurrent state: a 183 MiB snapshot, 480 KiB a 16-token block.
    gdn = LinearStateSpec((3, 2 * 16 * 128 + 64 * 128), (64, 128, 128), "bfloat16", "float32")
    specs = {i: (FullAttentionSpec(2, 256, "bfloat16") if i % 4 == 3 else gdn) for i in range(60)}
    plan = CachePlan.from_specs(specs, 60, 16)
    assert plan.bytes_per_block == 480 * 1024 and round(plan.bytes_per_slot / 2**20) == 183
    assert plan.snapshot_stride(None) == 391 and plan.snapshot_stride(4) == 4
    blocks, snaps = plan.split_budget(70 << 30, True)
    assert snaps == int((70 << 30) * SNAPSHOT_MEMORY_SHARE) // plan.bytes_per_slot == 39
    assert blocks * plan.bytes_per_block + snaps * plan.bytes_per_slot <= 70 << 30
    assert plan.split_budget(70 << 30, False) == ((70 << 30) // plan.bytes_per_block, 0)
    # A state far smaller than a block: the share would buy thousands of snapshots, but only as many as blocks.
    small = CachePlan.from_specs({0: LinearStateSpec((1, 4), (1, 2, 2), "float32"),
                                  1: FullAttentionSpec(64, 128, "float32")}, 2, 16)
    assert small.bytes_per_block == 1 << 20 and small.split_budget(3 << 20, True) == (2, 2)


class StateTrackingRunner:
    """A runner without a model that tracks what each state slot and snapshot holds: the token prefix a Gated
    DeltaNet state would summarize. A step starting at position p > 0 must find exactly tokens[:p] in its slot (a
    snapshot restored into it, or its own earlier chunks); a save must name a block boundary inside its row's tokens
    this step, and holds that prefix. Tokens are a function of (request, position), sampled at launch (so async
    scheduling sees them in flight)."""

    def __init__(self, num_blocks, num_slots, num_snapshots, stride, block_size):
        self.num_blocks, self.num_state_slots = num_blocks, num_slots
        self.num_state_snapshots, self.state_snapshot_stride = num_snapshots, stride
        self.block_size = block_size
        self.slot_of, self.tokens, self.slots, self.snaps = {}, {}, {}, {}
        self.num_restored_steps = 0

    def launch(self, batch):
        from types import SimpleNamespace

        from gyrfalcon.step_io import RunnerOutput

        for rid in batch.finished_request_ids:
            self.tokens.pop(rid, None)
        for sid, slot in batch.state_restores:
            self.slots[slot] = self.snaps[sid]
        sampled = []
        for sr in batch.reqs:
            if sr.new_request is not None:
                self.tokens[sr.request_id] = list(sr.new_request.prompt_token_ids) + list(
                    sr.new_request.output_token_ids)
                self.slot_of[sr.request_id] = sr.new_request.state_slots["state"]
            toks, slot = self.tokens[sr.request_id], self.slot_of[sr.request_id]
            held = self.slots.get(slot) if sr.start else ()
            assert held == tuple(toks[:sr.start]), (sr.request_id, sr.start)
            self.num_restored_steps += bool(sr.start and sr.new_request is not None)
            end = sr.start + sr.num_new_tokens
            assert end <= len(toks)
            self.slots[slot] = tuple(toks[:end])
            if sr.sample:
                toks.append((hash(sr.request_id) + end) % 97 + 1)
                sampled.append([toks[-1]])
            else:
                sampled.append([])
        for row, pos, sid in batch.state_saves:
            sr = batch.reqs[row]
            assert pos % self.block_size == 0 and sr.start < pos <= sr.start + sr.num_new_tokens, (sr, pos)
            self.snaps[sid] = tuple(self.tokens[sr.request_id][:pos])
        return SimpleNamespace(batch=batch, out=RunnerOutput(sampled, [()] * len(sampled)))

    def complete(self, handle):
        return handle.out


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_traffic_restores_exact_states(seed, async_scheduling):
    """Random prompts over a few shared prefixes, random budgets and strides, a cache small enough to preempt, a
    snapshot pool small enough to evict, random aborts: every step finds its slot holding exactly the prefix it
    starts after, snapshots are hit, and every block and slot is back at the end."""
    from types import SimpleNamespace

    from gyrfalcon.engine.engine import Engine

    rng = random.Random(seed)
    bs = 4
    runner = StateTrackingRunner(num_blocks=28, num_slots=4, num_snapshots=rng.choice([2, 5]),
                                 stride=rng.choice([1, 2, 3]), block_size=bs)
    cfg = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=bs, enable_prefix_caching=True),
        scheduler_config=SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=rng.choice([7, 16, 40]),
                                         enable_chunked_prefill=True, async_scheduling=async_scheduling),
        model_config=SimpleNamespace(max_model_len=100, hf_config=SimpleNamespace(vocab_size=100)))
    eng = Engine(cfg, [], runner=runner)
    stems = [[rng.randint(1, 99) for _ in range(60)] for _ in range(3)]
    n = 0
    for _ in range(25):
        for _ in range(rng.randint(1, 4)):
            stem = rng.choice(stems)
            prompt = stem[:rng.randint(1, 60)] + [rng.randint(1, 99) for _ in range(rng.randint(0, 6))]
            eng.add_request(f"r{n}", prompt or [1], SamplingParams(max_tokens=rng.randint(1, 30), ignore_eos=True))
            n += 1
        for _ in range(rng.randint(1, 6)):
            eng.step()
            if rng.random() < 0.1 and eng.scheduler.running:
                eng.abort_request(rng.choice(eng.scheduler.running).request_id)
    while eng.has_unfinished_requests():
        eng.step()
    sched, bm = eng.scheduler, eng.block_manager
    assert runner.num_restored_steps > 0 and sched.snapshots.num_restores == runner.num_restored_steps
    assert sched.num_preemptions_total > 0 and sched.snapshots.num_evictions > 0
    assert sched.state_manager.num_free_slots == 4 and bm.num_free_blocks == bm.num_blocks
