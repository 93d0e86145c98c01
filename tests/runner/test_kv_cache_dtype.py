"""kv_cache_dtype="fp8": K/V stored as float8 e4m3 (half of bf16's bytes, a quarter of fp32's)."""

from __future__ import annotations

import pytest
import torch

from gyrfalcon.sampling_params import SamplingParams


def test_rejects_unknown_kv_cache_dtype(qwen3_ckpt):
    from gyrfalcon import LLM

    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(str(qwen3_ckpt), max_model_len=64, kv_cache_dtype="int4")


def test_fp8_cache_holds_more_blocks_and_generates_close_to_full_precision(qwen3_ckpt):
    from gyrfalcon import LLM

    # A budget small enough that the blocks, not max_num_seqs x max_model_len (the CPU cap), bound the cache.
    kw = dict(max_model_len=64, max_num_seqs=4, cpu_kv_cache_gb=2 ** -14)
    full = LLM(str(qwen3_ckpt), **kw)
    fp8 = LLM(str(qwen3_ckpt), kv_cache_dtype="fp8", **kw)
    r_full, r_fp8 = full.engine.runner, fp8.engine.runner
    assert r_full.kv_caches[0][0].dtype == torch.float32  # the CPU's model dtype
    assert r_fp8.kv_caches[0][0].dtype == torch.float8_e4m3fn
    assert r_fp8.bytes_per_block * 4 == r_full.bytes_per_block
    assert abs(r_fp8.num_blocks - 4 * r_full.num_blocks) <= 3  # the same bytes (64 KiB)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11]}, {"prompt_token_ids": [40, 41, 42]}]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    a = full.generate(prompts, sp, use_tqdm=False)
    b = fp8.generate(prompts, sp, use_tqdm=False)
    for oa, ob in zip(a, b):
        assert len(ob.outputs[0].token_ids) == 6
        # The first token's top-3 log-probabilities: mostly the same tokens (this random model's top
        # tokens lie within ~0.06 nats of each other, so their order may swap), each within fp8's rounding
        # (3 mantissa bits: ~3% per K/V element; 0.07 nats seen here; a wrong scale or layout moves
        # them by whole nats).
        la, lb = oa.outputs[0].logprobs[0], ob.outputs[0].logprobs[0]
        shared = set(la) & set(lb)
        assert len(shared) >= 2
        for t in shared:
            assert abs(la[t].logprob - lb[t].logprob) < 0.15
