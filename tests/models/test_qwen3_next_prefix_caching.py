"""Exact prefix caching for a hybrid model (tiny Qwen3-Next, fp32, CPU): a request that shares a cached prefix with an
earlier one restores the Gated DeltaNet state snapshotted at the last shared block boundary, skips those tokens, and
still matches transformers (greedy tokens, and every step's full distribution within 1e-5), for shared prefixes of 1,
2, ... blocks (far below vLLM's 528-token 'align' granularity) and past the rule's 64-token chunks; a multi-turn chat
hits its earlier turns; a pool too small for the snapshots evicts without wrong results; preemption and aborts free
slots and the recomputed requests resume from snapshots. Snapshots are taken inside a step (the layers write them
during the forward): a prompt runs in one step whatever it saves. tests/models/test_qwen3_5.py runs
shared_prefix_parity on its checkpoints too."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from checkpoints import make_qwen3_next_checkpoint
from gyrfalcon import LLM, SamplingParams
from gyrfalcon.engine.snapshot_pool import SnapshotPool
from test_model_parity import _assert_all_blocks_free

NEW = 6
BS = 8


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    return make_qwen3_next_checkpoint(tmp_path_factory.mktemp("qwen3_next_pc"))


class Oracle:
    """transformers' greedy continuation (NEW tokens) and its per-step logits, per prompt, computed once each."""

    def __init__(self, model) -> None:
        self.model, self.cache = model, {}

    def __call__(self, prompt):
        key = tuple(prompt)
        if key not in self.cache:
            out = self.model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                      pad_token_id=0, output_logits=True, return_dict_in_generate=True)
            self.cache[key] = (out.sequences[0, len(prompt):].tolist(), torch.stack(out.logits, 0)[:, 0].float())
        return self.cache[key]


@pytest.fixture(scope="module")
def oracle(tiny_ckpt):
    return Oracle(AutoModelForCausalLM.from_pretrained(str(tiny_ckpt), dtype=torch.float32).eval())


def tokens(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(n)]


def generate_checked(llm, oracle, prompts, vocab):
    """Greedy NEW tokens for each prompt (one batch), each equal to transformers' and each step's logprobs over the
    whole vocabulary within 1e-5 of its log_softmax; returns the outputs."""
    sp = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=vocab)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for p, out in zip(prompts, outs):
        ref_tokens, ref_logits = oracle(p)
        assert out.outputs[0].token_ids == ref_tokens
        for step, entry in enumerate(out.outputs[0].logprobs):
            got = torch.full((vocab,), float("nan"))
            for tid, lp in entry.items():
                got[tid] = lp.logprob
            torch.testing.assert_close(got, ref_logits[step].log_softmax(-1), rtol=1e-5, atol=1e-5)
    return outs


class StepRecorder:
    """Wraps a runner: keeps every launched ScheduledBatch (its requests' spans and saves)."""

    def __init__(self, inner):
        self.inner, self.batches = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def launch(self, batch):
        self.batches.append(batch)
        return self.inner.launch(batch)

    def complete(self, handle):
        return self.inner.complete(handle)


def _assert_all_slots_free(llm):
    sm = llm.engine.scheduler.state_manager
    assert sm.num_free_slots == sm.num_slots


def shared_prefix_parity(ckpt, oracle, **llm_kw):
    """A 150-token prompt, then (in one batch) prompts sharing its first k blocks for k = 1, 2, 3, 9, 17 (8 to 136
    tokens) and diverging right after: each resumes at exactly k blocks (stride 1: a snapshot at every boundary) and
    matches transformers; the hits are counted in the prefix-cache statistics as for a dense model. The first prompt
    runs in ONE step that writes all 18 of its boundary snapshots."""
    llm = LLM(str(ckpt), block_size=BS, linear_state_snapshot_stride=1, **llm_kw)
    rec = llm.engine.runner = StepRecorder(llm.engine.runner)
    vocab = llm.engine.vocab_size
    base = tokens(150, 1)
    first = generate_checked(llm, oracle, [base], vocab)[0]
    assert first.num_cached_tokens == 0
    prefill = [b for b in rec.batches if b.reqs and b.reqs[0].start == 0]
    assert len(prefill) == 1 and prefill[0].reqs[0].num_new_tokens == 150
    assert [pos for _, pos, _ in prefill[0].state_saves] == [BS * j for j in range(1, 19)]
    rec.batches.clear()
    shares = [1, 2, 3, 9, 17]
    prompts = [base[:k * BS] + [(base[k * BS] + 1) % 500 + 1] + tokens(4 + k % 3, 100 + k) for k in shares]
    outs = generate_checked(llm, oracle, prompts, vocab)
    assert [o.num_cached_tokens for o in outs] == [k * BS for k in shares]
    # One step runs every suffix (and saves the boundaries they cross), then decode steps.
    assert [sr.start for sr in rec.batches[0].reqs] == [k * BS for k in shares]
    assert all(sr.num_new_tokens == 1 for b in rec.batches[1:] for sr in b.reqs)
    bm = llm.engine.block_manager
    assert bm.prefix_hits == sum(shares) * BS and bm.prefix_queries == 150 + sum(len(p) for p in prompts)
    _assert_all_blocks_free(llm)
    _assert_all_slots_free(llm)
    return llm


def test_shared_prefixes_of_every_length_hit_exactly(tiny_ckpt, oracle):
    shared_prefix_parity(tiny_ckpt, oracle)


def test_one_token_chunks_save_their_boundaries(tiny_ckpt, oracle):
    """A budget of one token a step: every prefill step is decode-shaped (one token per row), and the steps whose
    token ends a block boundary still write its snapshot (through the prefill ops); a later prompt restores them."""
    llm = LLM(str(tiny_ckpt), block_size=BS, linear_state_snapshot_stride=1, max_num_batched_tokens=1)
    rec = llm.engine.runner = StepRecorder(llm.engine.runner)
    vocab = llm.engine.vocab_size
    base = tokens(20, 6)
    generate_checked(llm, oracle, [base], vocab)
    saving = [b for b in rec.batches if b.state_saves]
    assert [(b.reqs[0].start, b.reqs[0].num_new_tokens, b.state_saves[0][1]) for b in saving] == [(7, 1, 8),
                                                                                                   (15, 1, 16)]
    out = generate_checked(llm, oracle, [base[:16] + tokens(3, 61)], vocab)[0]
    assert out.num_cached_tokens == 16


def test_multi_turn_chat_hits_earlier_turns(tiny_ckpt, oracle):
    """Each turn's prompt is the last one, its answer and a new user message: it resumes at the last block boundary
    of the previous prompt (snapshotted there whatever the stride: the default one here), with async scheduling and
    a small token budget (chunks cut by the budget only, the boundary snapshots taken inside them)."""
    llm = LLM(str(tiny_ckpt), block_size=BS, async_scheduling=True, max_num_batched_tokens=20)
    assert llm.engine.scheduler.snapshots.stride > 1  # (the default: the blocks whose KV bytes make a snapshot)
    vocab = llm.engine.vocab_size
    prompt, expected = tokens(37, 2), 0
    for turn in range(3):
        out = generate_checked(llm, oracle, [prompt], vocab)[0]
        assert out.num_cached_tokens == expected
        expected = (len(prompt) - 1) // BS * BS
        prompt = prompt + list(out.outputs[0].token_ids) + tokens(9 + turn, 10 + turn)
    _assert_all_slots_free(llm)


def test_tiny_snapshot_pool_evicts_without_wrong_results(tiny_ckpt, oracle):
    """Three snapshots for many boundaries: saves evict the least recently used, later requests hit only what is
    left (or nothing), and every output is still transformers'."""
    llm = LLM(str(tiny_ckpt), block_size=BS, linear_state_snapshot_stride=1, max_num_batched_tokens=24)
    sched = llm.engine.scheduler
    sched.snapshots = SnapshotPool(3, 1)  # (ids 0..2 of the runner's larger pool)
    vocab = llm.engine.vocab_size
    base = tokens(90, 3)
    waves = [[base[:70]], [base[:20] + tokens(6, 30), base[:50] + tokens(5, 31)],
             [base[:70] + tokens(3, 32), base[:33], base[:20] + tokens(6, 30)]]
    hits = 0
    for wave in waves:
        outs = generate_checked(llm, oracle, wave, vocab)
        hits += sum(o.num_cached_tokens for o in outs)
    assert sched.snapshots.num_evictions > 0 and hits > 0
    assert hits == llm.engine.block_manager.prefix_hits
    _assert_all_blocks_free(llm)
    _assert_all_slots_free(llm)


def test_preemption_and_abort_with_snapshots(tiny_ckpt, oracle, monkeypatch):
    """A KV cache far too small for the batch (and most of the cache memory to snapshots, so this tiny model gets
    some): requests are preempted mid-prefill and mid-decode, come back through the snapshots they saved, and give
    transformers' tokens; an aborted request's slot is freed and its snapshots serve the next one."""
    from gyrfalcon.runner import kv_cache

    monkeypatch.setattr(kv_cache, "SNAPSHOT_MEMORY_SHARE", 0.8)
    base = tokens(80, 4)
    prompts = [base[:60] + tokens(5, 40 + i) for i in range(4)] + [base[:75]]
    blocks = -(-(max(len(p) for p in prompts) + NEW) // 4) + 2
    llm = LLM(str(tiny_ckpt), block_size=4, num_gpu_blocks_override=blocks, max_model_len=blocks * 4 - 4,
              max_num_batched_tokens=16, max_num_seqs=4, linear_state_snapshot_stride=2, async_scheduling=True)
    eng = llm.engine
    assert eng.scheduler.snapshots is not None and eng.runner.num_state_snapshots > 0
    outs = generate_checked(llm, oracle, prompts, eng.vocab_size)
    assert eng.scheduler.num_preemptions_total > 0 and eng.block_manager.prefix_hits > 0
    assert any(o.num_cached_tokens for o in outs[1:])
    _assert_all_blocks_free(llm)
    _assert_all_slots_free(llm)
    # Abort mid-prefill: the slot returns; the boundaries it saved serve the same prompt afterwards.
    prompt = base[:40] + tokens(20, 50)
    eng.add_request("abort-me", prompt, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    for _ in range(3):
        eng.step()
    saves = eng.scheduler.snapshots.num_saves
    eng.abort_request("abort-me")
    while eng.has_unfinished_requests():
        eng.step()
    _assert_all_slots_free(llm)
    out = generate_checked(llm, oracle, [prompt], eng.vocab_size)[0]
    assert saves > 0 and out.num_cached_tokens > 0


def test_snapshot_copies_cross_the_runner_boundary(tiny_ckpt, oracle):
    """The restores and saves travel in the plain-data batch: through msgpack (a runner in another process), the
    shared-prefix hits still restore exact states."""
    from engine.test_runner_boundary import _ThroughMsgpack

    llm = LLM(str(tiny_ckpt), block_size=BS, linear_state_snapshot_stride=2, max_num_batched_tokens=32)
    wrapped = llm.engine.runner = _ThroughMsgpack(llm.engine.runner)
    base = tokens(70, 5)
    generate_checked(llm, oracle, [base], llm.engine.vocab_size)
    outs = generate_checked(llm, oracle, [base[:40] + tokens(3, 51), base[:20] + tokens(5, 52)], llm.engine.vocab_size)
    assert [o.num_cached_tokens for o in outs] == [32, 16] and wrapped.num_steps > 5


def test_profile_step_saves_its_last_state(tiny_ckpt):
    """The startup's activation-profile step (run on a GPU before the caches are sized) saves, for a hybrid model with
    prefix caching, the state after its last token, so the kernels' saving variants compile at startup: that
    snapshot is the state the step leaves in its slot, conv window and recurrent state alike."""
    from gyrfalcon.runner.model_runner import profile_step

    runner = LLM(str(tiny_ckpt), block_size=BS).engine.runner
    caches = runner.cache_plan.allocate(10, 1, runner.device)
    snaps = runner.cache_plan.allocate_snapshots(1, runner.device)
    profile_step(runner.model, 70, 4, caches, BS, runner.device, snaps)
    layers = [i for i, pools in enumerate(snaps) if pools is not None]
    assert layers and all(caches[i] is not None for i in layers)
    for i in layers:
        for slot_pool, snap_pool in zip(caches[i], snaps[i]):
            assert slot_pool[0].abs().sum() > 0 and torch.equal(snap_pool[0], slot_pool[0])
