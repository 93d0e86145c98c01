"""CUDA graphs that capture the tensor-parallel collectives (distributed/graph_capture.py), on NCCL.

One GPU: this process joins an NCCL process group of world size 1 with the collectives forced on
(init_distributed(force_collectives=True)), so the layers take their tensor-parallel paths and every row-parallel
projection's and MoE block's all-reduce is a real NCCL call, captured inside the decode and prefill graphs. On tiny
random fp32 Llama and Qwen3-MoE checkpoints the graph replays give the same greedy tokens as the eager steps and
every step's full logprob distribution within fp32 tolerance; the capture did hold NCCL all-reduces; and a rank whose
capture fails falls back to eager steps (the agreement's path) with the same results.
Two GPUs (skipped with fewer): tensor_parallel_size 2 with its graphs against the same engine run eagerly.
Run through scripts/gpu/test.sh or `pytest tests/gpu/test_tp_graphs_gpu.py`."""

from __future__ import annotations

import json
import socket

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import torch.distributed as dist  # noqa: E402

from checkpoints import make_checkpoint, make_moe_checkpoint  # noqa: E402
from gyrfalcon import LLM, SamplingParams  # noqa: E402
from gyrfalcon.distributed import destroy_distributed, init_distributed, tp_collectives  # noqa: E402
from gyrfalcon.runner import cuda_graph  # noqa: E402

KW = dict(block_size=16, max_model_len=256, device="cuda", dtype="float32", num_gpu_blocks_override=64,
          max_num_batched_tokens=64, max_num_seqs=8)
# Chunked prefills of 64 tokens (the prefill graphs) and decode steps of 4 sequences (the decode graph of 4).
PROMPTS = [list(range(3, 100)), list(range(3, 40)) + [200, 201], [7], [90, 91, 92, 93, 94, 95]]
MAX_NEW = 12

CHECKPOINTS = {
    "llama": lambda p: make_checkpoint(p, "llama", num_key_value_heads=1, vocab_size=515, tie_word_embeddings=True),
    "qwen3moe": lambda p: make_moe_checkpoint(p, "qwen3_moe"),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return {name: make(tmp_path_factory.mktemp(name)) for name, make in CHECKPOINTS.items()}


def _vocab(ckpt) -> int:
    return json.loads((ckpt / "config.json").read_text())["vocab_size"]


def _generate(llm, vocab):
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=vocab)
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)]


def _assert_same(got, want):
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for w, g in zip(want, got):
        assert len(w.logprobs) == len(g.logprobs) == MAX_NEW
        for step_w, step_g in zip(w.logprobs, g.logprobs):
            ids = sorted(step_w)
            torch.testing.assert_close(torch.tensor([step_g[i].logprob for i in ids]),
                                       torch.tensor([step_w[i].logprob for i in ids]), rtol=1e-4, atol=1e-4)


def _shutdown(llm):
    llm.engine.shutdown()


# ---- two GPUs (first: before this process joins its own group below) ----------------------------------------
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_tp2_graphs_match_tp2_eager(ckpts, name):
    ckpt = ckpts[name]
    vocab = _vocab(ckpt)
    runs = {}
    for eager in (True, False):
        llm = LLM(str(ckpt), tensor_parallel_size=2, enforce_eager=eager, **KW)
        try:
            ex = llm.engine.runner
            assert bool(ex.graph_sizes) == (not eager) and bool(ex.mixed_graph_sizes) == (not eager)
            runs[eager] = _generate(llm, vocab)
        finally:
            _shutdown(llm)
    _assert_same(runs[False], runs[True])


# ---- one GPU, a world of one with the collectives forced on -----------------------------------------------------
@pytest.fixture(scope="module")
def nccl_world_of_one():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed(0, 1, f"tcp://127.0.0.1:{port}", device="cuda", timeout_s=120, force_collectives=True)
    assert tp_collectives() and dist.get_backend() == "nccl"
    yield
    destroy_distributed()


@pytest.fixture
def count_all_reduces(monkeypatch):
    """{"captured": all-reduces called while a CUDA graph was being captured, "eager": the others}."""
    counts = {"captured": 0, "eager": 0}
    orig = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        if tensor.is_cuda:
            counts["captured" if torch.cuda.is_current_stream_capturing() else "eager"] += 1
        return orig(tensor, *args, **kwargs)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return counts


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_graphs_with_nccl_collectives_match_eager(nccl_world_of_one, ckpts, count_all_reduces, monkeypatch, name):
    ckpt = ckpts[name]
    vocab = _vocab(ckpt)
    llm = LLM(str(ckpt), enforce_eager=True, **KW)
    want = _generate(llm, vocab)
    runner = llm.engine.runner
    assert runner.graph_runner is None and count_all_reduces["captured"] == 0
    assert count_all_reduces["eager"] > 0  # (the eager steps went through NCCL)
    del llm, runner

    llm = LLM(str(ckpt), enforce_eager=False, **KW)
    runner = llm.engine.runner
    assert runner.graph_runner is not None and runner.mixed_graph_runner is not None
    # Every layer's o_proj and MLP / MoE all-reduce of every captured size went into a graph.
    layers = len(runner.model.model.layers)
    captured_graphs = len(runner.graph_runner.graphs) + len(runner.mixed_graph_runner.graphs)
    assert count_all_reduces["captured"] >= 2 * layers * captured_graphs
    replays = []
    replay = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda g: (replays.append(g), replay(g))[1])
    got = _generate(llm, vocab)
    assert len(replays) >= MAX_NEW - 1  # (at least every decode step after the first token replayed a graph)
    _assert_same(got, want)


def test_failed_capture_falls_back_to_eager(nccl_world_of_one, ckpts, monkeypatch):
    """A capture that fails on this rank (a step raising inside the capture of the decode graph of 4 sequences):
    the ranks' agreement turns it into GraphCaptureFailed, and the engine runs its steps eagerly, right."""
    ckpt = ckpts["llama"]
    vocab = _vocab(ckpt)
    want = _generate(LLM(str(ckpt), enforce_eager=True, **KW), vocab)
    prepare = cuda_graph.CudaGraphRunner.prepare

    def failing_prepare(self, b, short=False, q=1):
        fb, step = prepare(self, b, short, q)
        if b != 4:
            return fb, step

        def step_failing_in_capture():
            out = step()
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("injected capture failure")
            return out
        return fb, step_failing_in_capture
    monkeypatch.setattr(cuda_graph.CudaGraphRunner, "prepare", failing_prepare)
    llm = LLM(str(ckpt), enforce_eager=False, **KW)
    runner = llm.engine.runner
    assert runner.graph_runner is None and runner.mixed_graph_runner is None  # every step eager
    _assert_same(_generate(llm, vocab), want)
