"""Verify steps of hybrid targets (Qwen3-Next, Qwen3.5: Gated DeltaNet layers) as captured CUDA graphs on the GPU,
fp32, k = 1..3, batches of 1, 3 and 8. With speculation on, the runner allocates each GDN layer's static
[rows, k, ...] scratch for the verify ladder and captures the (1 + k) verify graphs; the layers keep every row's
per-token states there inside the graph and complete() rolls rejected rows back with a gather. Drafts come from an
oracle (the reference continuation, one token spoiled at a cycling position) so verify steps keep 0..k drafts;
greedy outputs through the replayed graphs equal those without speculation and those of the same run with
enforce_eager (the eager verify steps). CPU twin: tests/spec_decode/test_hybrid_verify_graphs.py.
Run through scripts/gpu/test.sh or `pytest tests/gpu/test_hybrid_verify_graphs_gpu.py`."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parents[1] / "spec_decode"))

from checkpoints import make_qwen3_5_checkpoint, make_qwen3_next_checkpoint  # noqa: E402
from spec_testutil import OracleDrafts  # noqa: E402
from gyrfalcon import LLM, SamplingParams  # noqa: E402
from gyrfalcon.layers.gated_deltanet import GatedDeltaNet  # noqa: E402

BATCHES = (1, 3, 8)
MAX_TOKENS = 24
KW = dict(dtype="float32", max_model_len=256, max_num_seqs=8, num_gpu_blocks_override=256,
          enable_prefix_caching=False)


def _prompts():
    g = torch.Generator().manual_seed(0)
    lens = [5, 37, 12, 60, 9, 23, 44, 17]
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lens]


def _greedy(llm, b):
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in _prompts()[:b]], sp,
                                                         use_tqdm=False)]


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5"])
def target(request, tmp_path_factory):
    """(checkpoint path, {batch size: greedy outputs without speculation})."""
    tmp = tmp_path_factory.mktemp(request.param)
    path = (make_qwen3_next_checkpoint(tmp / "t") if request.param == "qwen3_next"
            else make_qwen3_5_checkpoint(tmp / "t", moe=False))
    llm = LLM(str(path), **KW)
    refs = {b: _greedy(llm, b) for b in BATCHES}
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return path, refs


def _oracle(refs, k):
    return OracleDrafts(_prompts(), refs, k, lambda d: (d + 1) % 500)


def _run(path, refs, k, b, enforce_eager):
    llm = LLM(str(path), **KW, enforce_eager=enforce_eager,
              speculative_config={"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 2})
    r = llm.engine.runner
    r.proposer = _oracle(refs[max(BATCHES)], k)
    replays = []
    if not enforce_eager:
        g = r.graph_runner
        assert g is not None and 1 + k in g.query_lens, "hybrid verify graphs were not captured"
        layers = [m for m in r.model.modules() if isinstance(m, GatedDeltaNet)]
        assert layers and all(m.verify_scratch is not None for m in layers)
        run = g.run

        def spy(sched_reqs, last_rows=None):
            if g.query_len_of(sched_reqs) == 1 + k:
                replays.append(len(sched_reqs))
            return run(sched_reqs, last_rows)
        g.run = spy
    out = _greedy(llm, b)
    s = llm.engine.spec_stats
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return out, replays, s


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("b", BATCHES)
def test_hybrid_verify_graphs_equal_eager_and_no_speculation(target, k, b):
    path, refs = target
    graphed, replays, stats = _run(path, refs, k, b, enforce_eager=False)
    eager, _, _ = _run(path, refs, k, b, enforce_eager=True)
    # Separately, so that a failure says which path left the reference: the eager verify steps (the prefill
    # kernels over 1 + k tokens, then the tracked one-by-one rollback) or the replayed graphs (the static scratch).
    assert eager == refs[b], "eager verify steps differ from the run without speculation"
    assert graphed == eager, "replayed verify graphs differ from the eager verify steps"
    assert replays, "no verify step replayed a graph"
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # drafts partly rejected
