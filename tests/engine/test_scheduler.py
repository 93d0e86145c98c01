"""Scheduler: continuous batching, token budget, chunked prefill, preemption, aborts; with a fake
runner so it runs without a model."""

from __future__ import annotations

import random

import pytest

from gyrfalcon.engine.block_manager import BlockManager
from gyrfalcon.engine.request import Request, RequestStatus
from gyrfalcon.engine.scheduler import Scheduler
from gyrfalcon.sampling_params import SamplingParams


def make(num_blocks=64, block_size=4, max_seqs=8, budget=32, caching=True):
    bm = BlockManager(num_blocks, block_size, caching)
    return Scheduler(bm, max_seqs, budget), bm


def run_step(s):
    """One step with a fake model: the next token is a function of the request and its position."""
    batch = s.schedule()
    sampled = [[(hash(r.request_id) + r.num_tokens) % 1000] if sr.sample else []
               for sr, r in zip(batch.reqs, batch.requests)]
    return batch, s.update(batch, sampled)


def req(rid, n, max_tokens=5):
    return Request(rid, [(7 * i) % 100 for i in range(n)], SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_budget_and_chunked_prefill_and_joining_batch():
    s, bm = make(budget=10)
    s.add_request(req("a", 23))
    b1, _ = run_step(s)
    assert [(r.request_id, r.num_new_tokens, r.sample) for r in b1.reqs] == [("a", 10, False)]
    s.add_request(req("b", 3))
    b2, _ = run_step(s)
    assert [(r.request_id, r.num_new_tokens) for r in b2.reqs] == [("a", 10), ]
    b3, ups = run_step(s)
    # a finishes its prompt (3 tokens) and samples; b joins the same step with its whole prompt.
    assert [(r.request_id, r.num_new_tokens, r.sample) for r in b3.reqs] == [("a", 3, True), ("b", 3, True)]
    assert {u.request_id for u in ups} == {"a", "b"}
    b4, _ = run_step(s)
    assert [(r.request_id, r.num_new_tokens) for r in b4.reqs] == [("a", 1), ("b", 1)]


def test_max_num_seqs_caps_running():
    s, _ = make(max_seqs=2, budget=100)
    for i in range(4):
        s.add_request(req(str(i), 3))
    b, _ = run_step(s)
    assert len(b.reqs) == 2 and s.num_waiting == 2


def test_all_blocks_return_after_finish_abort_and_preemption():
    rng = random.Random(0)
    s, bm = make(num_blocks=12, block_size=4, max_seqs=6, budget=16)
    for i in range(10):
        s.add_request(req(str(i), rng.randint(1, 20), max_tokens=rng.randint(1, 12)))
    finished, steps, aborted = set(), 0, False
    while s.has_unfinished_requests():
        _, ups = run_step(s)
        finished |= {u.request_id for u in ups if u.finished}
        steps += 1
        if steps == 5 and not aborted:
            victim = s.running[0].request_id if s.running else s.waiting[0].request_id
            assert s.finish_request(victim) is not None
            finished.add(victim)
            aborted = True
        assert steps < 500
    assert s.num_preemptions_total > 0
    assert finished == {str(i) for i in range(10)}
    assert bm.num_free_blocks == bm.num_blocks and all(c == 0 for c in bm.ref_cnt)


def test_preempted_request_recomputes_prompt_and_outputs():
    s, bm = make(num_blocks=5, block_size=4, max_seqs=4, budget=64, caching=False)
    a, b = req("a", 8, max_tokens=8), req("b", 8, max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    outs = {"a": [], "b": []}
    while s.has_unfinished_requests():
        _, ups = run_step(s)
        for u in ups:
            outs[u.request_id] += u.new_token_ids
    assert b.num_preemptions > 0
    # The fake model's tokens depend only on (request, length): preemption changed nothing.
    for r in (a, b):
        assert outs[r.request_id] == [(hash(r.request_id) + 8 + i) % 1000 for i in range(8)]
        assert r.status == RequestStatus.FINISHED_LENGTH


def test_abort_waiting_and_unknown():
    s, bm = make()
    s.add_request(req("a", 5))
    assert s.finish_request("a") is not None
    assert s.finish_request("a") is None
    assert not s.has_unfinished_requests()


def test_duplicate_id_rejected():
    s, _ = make()
    s.add_request(req("a", 5))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(req("a", 5))


def test_token_arriving_for_a_request_preempted_meanwhile():
    """Async scheduling: step N is scheduled (and preempts a request) before step N-1's token for
    that request is applied; the token is kept, and if it ends the request, the request leaves the
    waiting queue and frees everything."""
    for ends in (False, True):
        s, bm = make(num_blocks=4, block_size=4, max_seqs=4, budget=64, caching=False)
        a = Request("a", list(range(7)), SamplingParams(max_tokens=8, ignore_eos=True))
        b = Request("b", list(range(7)), SamplingParams(max_tokens=8), eos_token_ids=[777])
        s.add_request(a)
        s.add_request(b)
        prev = s.schedule()  # both prefill; each samples a token that is now in flight
        assert [r.num_inflight for r in prev.requests] == [1, 1]
        s.update(prev, [[1], [2]])
        prev = s.schedule()  # decode step N-1 for both (position 7: 2 blocks each, the cache is full)
        nxt = s.schedule()   # step N before N-1's tokens: a needs a 3rd block -> b is preempted
        assert nxt.num_preempted == 1 and b.status == RequestStatus.PREEMPTED and b.num_inflight == 1
        ups = s.update(prev, [[3], [777 if ends else 4]])
        assert b.output_token_ids[-1] == (777 if ends else 4) and b.num_inflight == 0
        if ends:
            assert b.is_finished and b not in s.waiting and b.block_ids == []
            assert any(u.request_id == "b" and u.finished for u in ups)
        else:
            assert b in s.waiting and not b.is_finished
        s.update(nxt, [[5]] * len(nxt.reqs))
        for _ in range(200):
            if not s.has_unfinished_requests():
                break
            run_step(s)
        assert not s.has_unfinished_requests()
        assert bm.num_free_blocks == bm.num_blocks


def test_history_dependent_requests_are_counted_until_they_end():
    """Engine._needs_exact_state skips its scan while no unfinished request has penalties or min_tokens."""
    s, _ = make(budget=100)
    s.add_request(req("plain", 3))
    s.add_request(Request("pen", [1, 2, 3], SamplingParams(max_tokens=2, presence_penalty=0.5)))
    s.add_request(Request("min", [1, 2], SamplingParams(max_tokens=3, min_tokens=2)))
    assert s.num_history_dependent == 2
    s.finish_request("pen")
    assert s.num_history_dependent == 1
    s.finish_request("pen")  # twice: nothing more
    assert s.num_history_dependent == 1
    for _ in range(10):
        run_step(s)
    assert not s.has_unfinished_requests() and s.num_history_dependent == 0


# ---- the plain-data contract and speculative (1 + k token) steps ----------------------------------------

def test_batch_is_plain_data_the_runner_can_rebuild_state_from():
    """A request's first step carries its prompt, params and blocks; later steps only new blocks; the batch
    survives msgpack (a runner in another process) without the engine's Request objects."""
    from gyrfalcon.step_io import decode_batch, encode_batch
    s, _ = make(block_size=4, budget=32)
    s.add_request(req("a", 6, max_tokens=8))
    b1, _ = run_step(s)
    sr = b1.reqs[0]
    assert sr.new_request is not None and sr.new_request.prompt_token_ids == [(7 * i) % 100 for i in range(6)]
    assert sr.new_block_ids == b1.requests[0].block_ids[:2] and sr.start == 0 and sr.num_new_tokens == 6
    b, _ = run_step(s)  # position 6: in the second block
    assert b.reqs[0].new_request is None and b.reqs[0].new_block_ids == ()  # no list built for nothing
    run_step(s)
    b, _ = run_step(s)  # position 8 starts a third block: only it is sent
    assert b.reqs[0].start == 8 and len(b.reqs[0].new_block_ids) == 1
    d = decode_batch(encode_batch(b1))
    assert d.reqs == b1.reqs and d.requests == [] and d.finished_request_ids == b1.finished_request_ids


def test_preempted_request_is_sent_again_whole():
    s, bm = make(num_blocks=6, block_size=4, max_seqs=4, budget=64)
    s.add_request(req("a", 8, max_tokens=20))
    s.add_request(req("b", 8, max_tokens=20))
    seen = {}
    for _ in range(12):
        b, _ = run_step(s)
        for sr, r in zip(b.reqs, b.requests):
            if sr.new_request is not None:
                seen.setdefault(sr.request_id, []).append(len(sr.new_request.output_token_ids))
                assert sr.start == r.num_computed_tokens - sr.num_new_tokens
                assert sr.new_block_ids == r.block_ids[:len(sr.new_block_ids)]
        if not s.has_unfinished_requests():
            break
    # One of them was preempted and resumed with the outputs it had: sent twice, the second time with outputs.
    assert any(len(v) >= 2 and v[-1] > 0 for v in seen.values()), seen


def _spec_step(s, drafts_for, accept):
    """Schedule with drafts proposed for each running request; the fake runner accepts `accept(i, drafts)` of
    them and adds one token."""
    for r in s.running:
        r.spec_token_ids = drafts_for(r)
    batch = s.schedule()
    sampled = []
    for sr, r in zip(batch.reqs, batch.requests):
        if not sr.sample:
            sampled.append([])
            continue
        n = accept(r, sr.spec_token_ids)
        sampled.append(list(sr.spec_token_ids[:n]) + [900 + r.num_output_tokens + n])
    return batch, s.update(batch, sampled)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_spec_tokens_scheduled_and_rolled_back(k):
    s, bm = make(block_size=4, budget=64)
    s.add_request(req("a", 5, max_tokens=30))
    run_step(s)  # prefill
    r = s.running[0]
    computed, n_out = r.num_computed_tokens, r.num_output_tokens
    # All drafts accepted: 1 + k tokens run, k + 1 appended, every position's K/V valid.
    b, ups = _spec_step(s, lambda r: [1] * k, lambda r, d: len(d))
    assert b.reqs[0].num_new_tokens == 1 + k and b.reqs[0].spec_token_ids == [1] * k and b.reqs[0].sample
    assert r.num_output_tokens == n_out + k + 1 and r.num_computed_tokens == computed + 1 + k
    assert r.num_computed_tokens == r.num_tokens - 1 and len(ups[0].new_token_ids) == k + 1
    # None accepted: the k stale positions run again.
    computed, n_out = r.num_computed_tokens, r.num_output_tokens
    _spec_step(s, lambda r: [2] * k, lambda r, d: 0)
    assert r.num_output_tokens == n_out + 1 and r.num_computed_tokens == computed + 1 == r.num_tokens - 1
    b, _ = run_step(s)  # an ordinary step after a rollback: one token from the right position
    assert b.reqs[0].start == r.num_tokens - 2 and b.reqs[0].num_new_tokens == 1 and not b.reqs[0].spec_token_ids


def test_spec_tokens_capped_by_max_tokens_and_budget():
    s, _ = make(block_size=4, budget=64)
    s.add_request(req("a", 5, max_tokens=4))
    run_step(s)  # 1 output
    b, _ = _spec_step(s, lambda r: [3] * 6, lambda r, d: len(d))
    assert b.reqs[0].spec_token_ids == [3, 3]  # 1 + 2 drafts + the bonus token = max_tokens
    assert s.requests == {} and not s.has_unfinished_requests()  # finished at 4 tokens, blocks freed
    s2, _ = make(block_size=4, budget=3)
    s2.add_request(req("b", 2, max_tokens=20))
    run_step(s2)
    b, _ = _spec_step(s2, lambda r: [3] * 6, lambda r, d: len(d))
    assert b.reqs[0].num_new_tokens == 3 and len(b.reqs[0].spec_token_ids) == 2


def test_stop_token_inside_accepted_drafts_ends_there():
    s, bm = make(block_size=4, budget=64)
    r = Request("a", [5, 6, 7], SamplingParams(max_tokens=20, stop_token_ids=[42]))
    s.add_request(r)
    run_step(s)
    _, ups = _spec_step(s, lambda r: [1, 42, 1], lambda r, d: len(d))
    assert ups[0].new_token_ids == [1, 42] and ups[0].finished and ups[0].finish_reason == "stop"
    assert bm.num_free_blocks == bm.num_blocks


def test_state_slots_held_from_admission_to_end():
    """Models with linear-attention layers: each running request holds one state slot; admission waits for a
    free slot; finishing, aborting and preemption return it; the runner learns the slot with the request."""
    from gyrfalcon.engine.state_manager import StateManager
    bm = BlockManager(64, 4, True)
    sm = StateManager(2)
    s = Scheduler(bm, 8, 64, state_manager=sm)
    for rid in "abc":
        s.add_request(req(rid, 5, max_tokens=3))
    b, _ = run_step(s)
    assert [sr.request_id for sr in b.reqs] == ["a", "b"] and sm.num_free_slots == 0
    assert sorted(sr.new_request.state_slots["state"] for sr in b.reqs) == [0, 1]
    s.finish_request("a")
    b, _ = run_step(s)
    c = [sr for sr in b.reqs if sr.request_id == "c"][0]
    assert c.new_request.state_slots == {"state": 0}
    while s.has_unfinished_requests():
        run_step(s)
    assert sm.num_free_slots == 2 and bm.num_free_blocks == bm.num_blocks


def test_history_dependent_sampling_gets_drafts_too():
    """Penalties and min_tokens read the request's own outputs: the runner counts the drafts ahead of each verify
    row in that history (tests/spec_decode/test_sampled.py), so such requests are drafted for like any other."""
    s, _ = make(block_size=4, budget=64)
    s.add_request(Request("p", [5, 6, 7], SamplingParams(max_tokens=10, ignore_eos=True, presence_penalty=0.5)))
    s.add_request(Request("q", [5, 6, 7], SamplingParams(max_tokens=10, ignore_eos=True)))
    run_step(s)
    b, _ = _spec_step(s, lambda r: [1, 2], lambda r, d: len(d))
    assert {sr.request_id: len(sr.spec_token_ids) for sr in b.reqs} == {"p": 2, "q": 2}
