"""prompt_logprobs against transformers (fp32, CPU): the logprob, rank and top-k of every prompt token
given the tokens before it, through chunked prefill, prefix caching (bypassed), async scheduling and
preemption (not reported twice), with n > 1 (reported once)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from gyrfalcon import LLM, SamplingParams

PROMPTS = [list(range(5, 45)), list(range(100, 103)), [7], list(range(60, 90))]


@pytest.fixture(scope="module")
def hf_prompt_logprobs(tiny_ckpt):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_ckpt), dtype=torch.float32).eval()
    refs = []
    with torch.no_grad():
        for p in PROMPTS:
            lsm = model(torch.tensor([p])).logits[0].float().log_softmax(-1)
            refs.append(lsm)  # row j: the distribution of token j + 1
    return refs


def _check(out, prompt, lsm, k):
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(prompt) and plp[0] is None
    for j in range(1, len(prompt)):
        entry, tok = plp[j], prompt[j]
        row = lsm[j - 1]
        assert next(iter(entry)) == tok  # the prompt token first
        assert abs(entry[tok].logprob - row[tok].item()) < 1e-4
        assert entry[tok].rank == int((row > row[tok]).sum()) + 1
        top = row.topk(k).indices.tolist()
        assert set(top) <= set(entry) and len(entry) <= k + 1
        for r, t in enumerate(top, start=1):
            assert entry[t].rank == r and abs(entry[t].logprob - row[t].item()) < 1e-4


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("budget", [8, 64], ids=["chunked", "whole"])
def test_prompt_logprobs_match_transformers(tiny_ckpt, hf_prompt_logprobs, async_scheduling, budget):
    llm = LLM(str(tiny_ckpt), block_size=4, max_model_len=128, max_num_batched_tokens=budget,
              async_scheduling=async_scheduling)
    # A prefix-cache hit must not skip prompt positions: run the prompts once without, once with.
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=1), use_tqdm=False)
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    for out, p, lsm in zip(outs, PROMPTS, hf_prompt_logprobs):
        _check(out, p, lsm, 3)
        assert len(out.outputs[0].token_ids) == 3
    # Without prompt_logprobs: none reported.
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert out.prompt_logprobs is None
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_prompt_logprobs_zero_top_and_n_samples(tiny_ckpt, hf_prompt_logprobs):
    llm = LLM(str(tiny_ckpt), block_size=4, max_model_len=128, max_num_batched_tokens=16)
    sp = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=2, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], sp, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    _check(out, PROMPTS[0], hf_prompt_logprobs[0], 0)
    assert all(len(e) == 1 for e in out.prompt_logprobs[1:])  # only the prompt token itself


def test_prompt_logprobs_survive_preemption(tiny_ckpt, hf_prompt_logprobs):
    """A KV cache too small for every request at once: preempted requests recompute their prompts, and
    still report each prompt logprob exactly once."""
    llm = LLM(str(tiny_ckpt), block_size=4, max_model_len=80, max_num_batched_tokens=16,
              num_gpu_blocks_override=24)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions_total > 0
    for out, p, lsm in zip(outs, PROMPTS, hf_prompt_logprobs):
        _check(out, p, lsm, 1)


def test_prompt_logprobs_validation():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
