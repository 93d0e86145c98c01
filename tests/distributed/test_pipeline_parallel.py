"""pipeline_parallel_size=2 over gloo (two worker processes on the CPU, stage 0: layers 0-1 and the embedding,
stage 1: layers 2-3, the final norm and the LM head) against one process on a tiny Llama: the same greedy tokens
and every step's distribution within fp32 tolerance, seeded sampling alike; each stage holds and caches only its
layers."""

from __future__ import annotations

import pytest
import torch

from checkpoints import make_checkpoint
from gyrfalcon import LLM, SamplingParams

KW = dict(block_size=8, max_model_len=128, device="cpu", num_gpu_blocks_override=64, max_num_batched_tokens=32)
PROMPTS = [list(range(3, 43)), list(range(3, 27)) + [200, 201], [7], [90, 91, 92, 93, 94, 95]]


def _generate(llm, vocab):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=vocab)
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=6, ignore_eos=True, n=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS + [PROMPTS[3]]], [greedy] * len(PROMPTS) + [seeded],
                        use_tqdm=False)
    return [o.outputs[0] for o in outs[:-1]] + list(outs[-1].outputs)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ckpt = make_checkpoint(tmp_path_factory.mktemp("llama4"), "llama", num_hidden_layers=4)
    one = LLM(str(ckpt), **KW)
    vocab = one.engine.vocab_size
    want = _generate(one, vocab)
    del one
    llm = LLM(str(ckpt), pipeline_parallel_size=2, **KW)
    try:
        assert llm.engine.runner.world_size == 2
        got = _generate(llm, vocab)
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
    finally:
        llm.engine.shutdown()
    return want, got


def test_same_tokens(runs):
    want, got = runs
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(len(o.token_ids) == 6 for o in got)


def test_same_distributions(runs):
    want, got = runs
    for w, g in zip(want[:len(PROMPTS)], got[:len(PROMPTS)]):
        for step_w, step_g in zip(w.logprobs, g.logprobs):
            ids = sorted(step_w)
            torch.testing.assert_close(torch.tensor([step_g[i].logprob for i in ids]),
                                       torch.tensor([step_w[i].logprob for i in ids]), rtol=1e-5, atol=1e-5)


def test_stage_builds_its_layers_only(monkeypatch, tmp_path):
    """Stage 1 of 2 (the state set by hand: building needs no process group) builds layers 2-3 and their caches,
    and loading skips the other stage's tensors."""
    from transformers import AutoConfig

    from gyrfalcon.distributed import parallel_state
    from gyrfalcon.models.causal_lm import MissingLayer
    from gyrfalcon.models.llama import LlamaForCausalLM

    ckpt = make_checkpoint(tmp_path, "llama", num_hidden_layers=4)
    monkeypatch.setattr(parallel_state, "_STATE", parallel_state.ParallelState(pp_rank=1, pp_size=2))
    model = LlamaForCausalLM(AutoConfig.from_pretrained(str(ckpt)), max_position=64)
    assert [type(m) is MissingLayer for m in model.model.layers] == [True, True, False, False]
    assert sorted(model.kv_cache_specs("float32")) == [2, 3]
    from safetensors.torch import load_file
    sd = load_file(str(next(ckpt.glob("*.safetensors"))))
    assert model.load_weights(sd.items()) == model.expected_weights()
    assert not any(".layers.0." in n or ".layers.1." in n for n in model.expected_weights())


def test_pipeline_config_errors():
    from gyrfalcon.config import ParallelConfig
    with pytest.raises(ValueError, match="positive"):
        ParallelConfig(pipeline_parallel_size=0).verify()
    with pytest.raises(ValueError, match="not supported yet"):
        ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2).verify()
    pc = ParallelConfig(pipeline_parallel_size=2)
    pc.verify()
    assert pc.distributed_executor_backend == "mp" and pc.world_size == 2
