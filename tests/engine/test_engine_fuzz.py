"""Random mixes of every request feature (sampling knobs, seeds, n, logprobs, prompt logprobs, logit
bias, penalties, min_tokens, stop ids) in small KV caches that force preemption, sync and async, with
prefix caching on and off: no error, outputs of the asked shape, and every block back at the end."""

from __future__ import annotations

import random

import pytest

from gyrfalcon import LLM, SamplingParams


def _random_request(rng: random.Random, vocab: int):
    n = rng.randint(1, 50)
    ids = [rng.randint(3, vocab - 1) for _ in range(n)] if rng.random() < 0.5 else [5 + rng.randint(0, 3)] * n
    kw = dict(max_tokens=rng.randint(1, 30), ignore_eos=rng.random() < 0.5)
    if rng.random() < 0.5:
        kw.update(temperature=rng.choice([0, 0.7, 1.2]), top_p=rng.choice([1.0, 0.8]), top_k=rng.choice([0, 5]),
                  min_p=rng.choice([0, 0.1]))
    if rng.random() < 0.3:
        kw["seed"] = rng.randint(0, 10**9)
    if rng.random() < 0.3:
        kw["n"] = rng.randint(1, 3)
    if rng.random() < 0.3:
        kw["logprobs"] = rng.randint(0, 3)
    if rng.random() < 0.3:
        kw["prompt_logprobs"] = rng.randint(0, 2)
    if rng.random() < 0.3:
        kw["logit_bias"] = {rng.randint(0, vocab - 1): rng.uniform(-100, 100) for _ in range(3)}
    if rng.random() < 0.2:
        kw.update(presence_penalty=0.5, repetition_penalty=1.2)
    if rng.random() < 0.2:
        kw["min_tokens"] = min(3, kw["max_tokens"])
    if rng.random() < 0.2:
        kw["stop_token_ids"] = [rng.randint(0, vocab - 1)]
    return {"prompt_token_ids": ids}, SamplingParams(**kw)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["cache", "nocache"])
def test_random_request_mixes_under_preemption(qwen3_ckpt, async_scheduling, prefix_caching):
    rng = random.Random(1000 + 2 * async_scheduling + prefix_caching)
    llm = LLM(str(qwen3_ckpt), block_size=4, max_model_len=96, max_num_batched_tokens=rng.choice([8, 16, 40]),
              num_gpu_blocks_override=40, async_scheduling=async_scheduling, enable_prefix_caching=prefix_caching,
              max_num_seqs=6)
    vocab = llm.engine.config.model_config.hf_config.vocab_size
    for _ in range(20):
        reqs = [_random_request(rng, vocab) for _ in range(rng.randint(1, 6))]
        outs = llm.generate([r[0] for r in reqs], [r[1] for r in reqs], use_tqdm=False)
        for out, (prompt, sp) in zip(outs, reqs):
            assert len(out.outputs) == sp.n
            if sp.prompt_logprobs is not None:
                assert len(out.prompt_logprobs) == len(prompt["prompt_token_ids"])
            for c in out.outputs:
                assert 1 <= len(c.token_ids) <= sp.max_tokens
                assert all(0 <= t < vocab for t in c.token_ids)
                if sp.logprobs is not None:
                    assert len(c.logprobs) == len(c.token_ids)
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        assert not llm.engine.has_unfinished_requests()
        assert llm.engine.scheduler.num_history_dependent == 0  # every finish path counted down
    assert llm.engine.scheduler.num_preemptions_total > 0
