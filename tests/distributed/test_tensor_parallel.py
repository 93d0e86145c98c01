"""tensor_parallel_size=2 over gloo (two worker processes on the CPU) against one process on tiny random
checkpoints: the same tokens (greedy, seeded n = 2, penalized), every greedy step's full distribution and the
prompt logprobs within fp32 tolerance.

Configs: Llama with one KV head (replicated on both ranks), an odd vocabulary (the last rank's padding rows) and a
tied LM head; Qwen3-MoE (Qwen3 attention split over its two KV heads, a dense layer, sparse layers) with the
experts split inside each expert, and with expert parallelism (each rank owns 4 of the 8 experts) under async
scheduling; DeepSeek-V3 (MLA heads split, grouped routing, shared expert) with the experts split, V3.2 (its sparse
indexer replicated, index_topk 4 < the prompts) with expert parallelism; Qwen3-Next (GDN heads split by key-head
group, gated attention) and Qwen3.5 (flat GDN projections, packed experts, expert parallelism), both with a state
snapshot at every block so a later request resumes from one; MiniMax-M2 with one K/V head (its whole-projection
q/k norm reduced across the ranks). Each config builds one tensor-parallel engine (module-scoped: worker startup is
most of the cost)."""

from __future__ import annotations

import pytest
import torch

from checkpoints import (make_checkpoint, make_deepseek_checkpoint, make_moe_checkpoint, make_qwen3_5_checkpoint,
                         make_qwen3_next_checkpoint)
from gyrfalcon import LLM, SamplingParams

KW = dict(block_size=8, max_model_len=128, device="cpu", num_gpu_blocks_override=64, max_num_batched_tokens=32)
# Longer than the step budget (chunked prefill), sharing a prefix (prefix-cache hits), and a one-token prompt.
PROMPTS = [list(range(3, 43)), list(range(3, 27)) + [200, 201], [7], [90, 91, 92, 93, 94, 95]]
MAX_NEW = 8

CHECKPOINTS = {
    "llama-1kv": lambda p: make_checkpoint(p, "llama", num_key_value_heads=1, vocab_size=515, tie_word_embeddings=True),
    "qwen3moe": lambda p: make_moe_checkpoint(p, "qwen3_moe"),
    "deepseek-v3": lambda p: make_deepseek_checkpoint(p),
    "deepseek-v32": lambda p: make_deepseek_checkpoint(p, v32=True),
    "qwen3-next": lambda p: make_qwen3_next_checkpoint(p),
    "qwen3.5": lambda p: make_qwen3_5_checkpoint(p),
    "minimax-1kv": lambda p: make_moe_checkpoint(p, "minimax_m2", num_key_value_heads=1),
}
# config -> (checkpoint, extra engine arguments)
CONFIGS = {
    "llama-1kv": ("llama-1kv", {}),
    "qwen3moe-tp": ("qwen3moe", {}),
    "qwen3moe-ep": ("qwen3moe", dict(enable_expert_parallel=True, async_scheduling=True)),
    "deepseek-v3-tp": ("deepseek-v3", {}),
    "deepseek-v32-ep": ("deepseek-v32", dict(enable_expert_parallel=True)),
    # (hybrids: a state snapshot at every block boundary, and blocks enough for a few snapshots beside them)
    "qwen3-next-tp": ("qwen3-next", dict(linear_state_snapshot_stride=1, num_gpu_blocks_override=256)),
    "qwen3.5-ep": ("qwen3.5", dict(enable_expert_parallel=True, linear_state_snapshot_stride=1,
                                   num_gpu_blocks_override=256)),
    # (the whole-projection q/k norm reduced across ranks, its one K/V head on both)
    "minimax-1kv-tp": ("minimax-1kv", {}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            made[name] = CHECKPOINTS[name](tmp_path_factory.mktemp(name))
        return made[name]
    return get


def _generate(llm, vocab):
    """The greedy runs' outputs (full logprobs) per prompt, then the other requests' outputs, then a later request
    extending the first prompt (a prefix-cache hit, which the hybrid models take from the state snapshot at its end),
    then the prompt logprobs of the last request: sampling paths whose state every rank keeps alike (seeded draws,
    penalties over the output history, n > 1) and the prompt-logprob path."""
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=vocab)
    others = [SamplingParams(temperature=0.8, seed=11, max_tokens=MAX_NEW, ignore_eos=True, n=2),
              SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, repetition_penalty=1.5,
                             presence_penalty=0.5),
              SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=3)]
    # (prompt logprobs over the longest prompt: its prefill takes two chunked steps)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS + [PROMPTS[2], PROMPTS[3], PROMPTS[0]]],
                        [greedy] * len(PROMPTS) + others, use_tqdm=False)
    (again,) = llm.generate([{"prompt_token_ids": PROMPTS[0] + [300, 301]}],
                            SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0] for o in outs[:len(PROMPTS)]] + [c for o in outs[len(PROMPTS):-1] for c in o.outputs] + \
        [again.outputs[0], outs[-1].outputs[0], outs[-1].prompt_logprobs]


@pytest.fixture(scope="module", params=list(CONFIGS))
def runs(request, checkpoints):
    """(one process's outputs, tensor_parallel_size=2's outputs, vocabulary size) of one config."""
    name, kw = CONFIGS[request.param]
    ckpt = checkpoints(name)
    kw = {**KW, **kw}
    one = LLM(str(ckpt), **kw)
    vocab = one.engine.vocab_size
    want = _generate(one, vocab)
    del one
    llm = LLM(str(ckpt), tensor_parallel_size=2, **kw)
    try:
        assert llm.engine.runner.world_size == 2
        got = _generate(llm, vocab)
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks and bm.prefix_hits > 0
    finally:
        llm.engine.shutdown()
    return want, got, vocab


def test_same_tokens(runs):
    want, got, _ = runs
    assert [o.token_ids for o in got[:-1]] == [o.token_ids for o in want[:-1]]
    assert all(len(o.token_ids) == MAX_NEW for o in got[:-2])


def test_same_prompt_logprobs(runs):
    want, got, _ = runs
    assert len(got[-1]) == len(PROMPTS[0]) == len(want[-1])
    for w, g in zip(want[-1][1:], got[-1][1:]):
        assert list(g) == list(w)
        torch.testing.assert_close([e.logprob for e in g.values()], [e.logprob for e in w.values()], rtol=1e-5,
                                   atol=1e-5)


def test_same_distributions(runs):
    """Every greedy step's logprobs over the whole vocabulary: the split GEMMs sum in another order, nothing else."""
    want, got, vocab = runs
    for w, g in zip(want[:len(PROMPTS)], got[:len(PROMPTS)]):
        for step_w, step_g in zip(w.logprobs, g.logprobs):
            assert len(step_g) == vocab
            ids = sorted(step_w)
            torch.testing.assert_close(torch.tensor([step_g[i].logprob for i in ids]),
                                       torch.tensor([step_w[i].logprob for i in ids]), rtol=1e-5, atol=1e-5)


def test_unsupported_family_refused_before_workers_start():
    from gyrfalcon.models.causal_lm import CausalLM
    from gyrfalcon.models.loader import check_tensor_parallel

    with pytest.raises(ValueError, match="does not support tensor parallelism"):
        check_tensor_parallel(CausalLM, 2)
    check_tensor_parallel(CausalLM, 1)


def test_parallel_config_errors():
    from gyrfalcon.config import ParallelConfig
    with pytest.raises(ValueError, match="positive"):
        ParallelConfig(tensor_parallel_size=0).verify()
    with pytest.raises(ValueError, match="'mp' or 'ray'"):
        ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="slurm").verify()
    pc = ParallelConfig(tensor_parallel_size=2)
    pc.verify()
    assert pc.distributed_executor_backend == "mp"


def test_dead_worker_raises_instead_of_hanging(qwen3_ckpt):
    """A worker killed while the engine waits for a step's output, or before the next step: WorkerDied at once,
    the other rank stopped, and every later call says the same."""
    import os
    import signal
    import time

    from gyrfalcon.engine.executor_mp import WorkerDied, _Handle
    from gyrfalcon.step_io import ScheduledBatch

    llm = LLM(str(qwen3_ckpt), tensor_parallel_size=2, **KW)
    ex = llm.engine.runner
    try:
        procs = list(ex._procs)
        t0 = time.monotonic()
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].join(10)
        with pytest.raises(WorkerDied, match=r"rank 0 .*exited with code -9"):
            ex.complete(_Handle(ScheduledBatch()))  # waiting for an output rank 0 will never send
        procs[1].join(10)
        assert not procs[1].is_alive()
        with pytest.raises(WorkerDied, match="rank 0"):
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2), use_tqdm=False)
        with pytest.raises(WorkerDied):
            llm.engine.check_health()
    finally:
        llm.engine.shutdown()
