"""--distributed-executor-backend ray: tensor_parallel_size=2 as two Ray actors (CPU bundles of a placement group)
on a local Ray cluster that the test starts on 127.0.0.1, against one process: the same greedy tokens and every
step's distribution within fp32 tolerance; a killed actor fails the engine (WorkerDied) instead of hanging it."""

from __future__ import annotations

import time

import pytest
import torch

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'gyrfalcon[ray]')")

from gyrfalcon import LLM, SamplingParams  # noqa: E402

KW = dict(block_size=8, max_model_len=128, device="cpu", num_gpu_blocks_override=64, max_num_batched_tokens=32)
PROMPTS = [list(range(3, 43)), [7], [90, 91, 92, 93, 94, 95]]


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()


def _greedy(llm, vocab):
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=vocab)
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)]


def test_ray_backend_matches_one_process(ray_cluster, qwen3_ckpt):
    one = LLM(str(qwen3_ckpt), **KW)
    vocab = one.engine.vocab_size
    want = _greedy(one, vocab)
    del one
    llm = LLM(str(qwen3_ckpt), tensor_parallel_size=2, distributed_executor_backend="ray", **KW)
    try:
        from gyrfalcon.engine.executor_ray import RayExecutor
        ex = llm.engine.runner
        assert isinstance(ex, RayExecutor) and ex.world_size == 2
        assert all(w.pid is not None for w in ex._procs)
        got = _greedy(llm, vocab)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        for w, g in zip(want, got):
            for step_w, step_g in zip(w.logprobs, g.logprobs):
                ids = sorted(step_w)
                torch.testing.assert_close(torch.tensor([step_g[i].logprob for i in ids]),
                                           torch.tensor([step_w[i].logprob for i in ids]), rtol=1e-5, atol=1e-5)
        # A killed actor: the next step raises WorkerDied, the other rank and the group released. It names rank 1
        # (its actor gone) or rank 0 (its all-reduce lost the peer: gloo's wording varies), whichever the engine
        # hears of first.
        from gyrfalcon.engine.executor_mp import WorkerDied
        ray.kill(ex._procs[1].actor, no_restart=True)
        with pytest.raises(WorkerDied, match=r"rank 1 .*ActorDiedError|rank 0 failed: RuntimeError: .*gloo"):
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2), use_tqdm=False)
        assert not ex._held
    finally:
        llm.engine.shutdown()
    # The placement group and the actors give their CPUs back (Ray's resource view catches up asynchronously).
    deadline = time.monotonic() + 20
    while ray.available_resources().get("CPU") != 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU") == 2, ray.available_resources()
