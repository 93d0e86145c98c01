"""tensor_parallel_size=2 over NCCL (two GPUs, one worker process each) against one GPU on tiny fp32 checkpoints:
the same greedy tokens and every step's logprobs within fp32 tolerance, for Llama with one K/V head (replicated)
and Qwen3-MoE with the experts split inside each expert and by expert (docs/parallelism.md). The same configs run
over gloo on the CPU in tests/distributed/; this is the NCCL path. Skipped without two GPUs.
Run through scripts/gpu/test.sh or `pytest tests/gpu/test_tensor_parallel_gpu.py`."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs", allow_module_level=True)

from checkpoints import make_checkpoint, make_moe_checkpoint  # noqa: E402
from gyrfalcon import LLM, SamplingParams  # noqa: E402

KW = dict(block_size=16, max_model_len=256, device="cuda", dtype="float32", num_gpu_blocks_override=64,
          max_num_batched_tokens=64)
PROMPTS = [list(range(3, 100)), list(range(3, 40)) + [200, 201], [7], [90, 91, 92, 93, 94, 95]]
MAX_NEW = 12

CONFIGS = {
    "llama-1kv": (lambda p: make_checkpoint(p, "llama", num_key_value_heads=1, vocab_size=515,
                                            tie_word_embeddings=True), {}),
    "qwen3moe-tp": (lambda p: make_moe_checkpoint(p, "qwen3_moe"), {}),
    "qwen3moe-ep": (lambda p: make_moe_checkpoint(p, "qwen3_moe"), dict(enable_expert_parallel=True)),
}


def _generate(llm, vocab):
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=vocab)
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tp2_matches_one_gpu(tmp_path, name):
    make, kw = CONFIGS[name]
    ckpt = make(tmp_path / name)
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    want = _generate(LLM(str(ckpt), **KW, **kw), vocab)
    llm = LLM(str(ckpt), tensor_parallel_size=2, **KW, **kw)
    try:
        got = _generate(llm, vocab)
    finally:
        llm.engine.shutdown()
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for w, g in zip(want, got):
        for step_w, step_g in zip(w.logprobs, g.logprobs):
            ids = sorted(step_w)
            torch.testing.assert_close(torch.tensor([step_g[i].logprob for i in ids]),
                                       torch.tensor([step_w[i].logprob for i in ids]), rtol=1e-4, atol=1e-4)
