"""Async scheduling (step N+1 scheduled before step N's tokens are read back) must produce exactly
what synchronous scheduling produces, for every way a request can end, and free every block."""

from __future__ import annotations

import pytest

from gyrfalcon import LLM, SamplingParams

PROMPTS = ["def add(a, b):", "The capital of", "import os\nimport sys\n", "x", "class A:\n    pass\n" * 3]


@pytest.fixture(scope="module")
def pair(qwen3_ckpt):
    kw = dict(block_size=4, max_model_len=256, max_num_batched_tokens=24)
    return LLM(str(qwen3_ckpt), **kw), LLM(str(qwen3_ckpt), async_scheduling=True, **kw)


def _all_free(llm):
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.has_unfinished_requests()


def _same(pair, params, prompts=PROMPTS):
    sync, asyn = pair
    a = sync.generate(prompts, params, use_tqdm=False)
    b = asyn.generate(prompts, params, use_tqdm=False)
    for x, y in zip(a, b):
        assert [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in x.outputs] == \
            [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in y.outputs]
    _all_free(sync)
    _all_free(asyn)
    return a


def test_greedy_lengths(pair):
    outs = _same(pair, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 20 for o in outs)


def test_mixed_max_tokens(pair):
    _same(pair, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 2, 7, 13, 30)])


def test_stop_token_ids_end_early(pair):
    base = pair[0].generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                            use_tqdm=False)
    stops = [o.outputs[0].token_ids[4] for o in base]
    outs = _same(pair, [SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[t]) for t in stops])
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)


def test_stop_strings_and_logprobs(pair):
    base = pair[0].generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                            use_tqdm=False)
    stop = base[0].outputs[0].text[3:6]
    _same(pair, SamplingParams(temperature=0, max_tokens=16, stop=[stop], logprobs=2), PROMPTS[:2])


def test_seeded_sampling_n(pair):
    _same(pair, SamplingParams(n=3, temperature=0.8, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True))


def test_penalties_and_min_tokens_wait_for_exact_state(pair):
    _same(pair, SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3, presence_penalty=0.5,
                               min_tokens=6, ignore_eos=False))


def test_abort_with_a_step_in_flight(pair):
    _, asyn = pair
    engine = asyn.engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"ab{i}", asyn.tokenizer(p)["input_ids"],
                           SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine._inflight is not None
    for i in range(0, len(PROMPTS), 2):
        assert engine.abort_request(f"ab{i}")
    finished = set()
    while engine.has_unfinished_requests():
        finished |= {u.request_id for u in engine.step() if u.finished}
    assert finished == {f"ab{i}" for i in range(1, len(PROMPTS), 2)}
    _all_free(asyn)


def test_preemption_in_flight(qwen3_ckpt):
    kw = dict(block_size=4, max_model_len=128, num_gpu_blocks_override=40, max_num_batched_tokens=16,
              enable_prefix_caching=False)
    sync, asyn = LLM(str(qwen3_ckpt), **kw), LLM(str(qwen3_ckpt), async_scheduling=True, **kw)
    _same((sync, asyn), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), PROMPTS * 2)
    assert asyn.engine.scheduler.num_preemptions_total > 0
