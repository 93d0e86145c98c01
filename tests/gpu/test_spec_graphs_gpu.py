"""The draft's passes as CUDA graphs (spec_decode/draft_graph.py) on the GPU, fp32: a random EAGLE-3 head on a tiny
4-layer Llama and DeepSeek-V3's MTP layer (the tiny checkpoints of tests/spec_decode), k = 1..4, batches of 1, 3
and 8 requests. With graphs on, the runner captures the draft's catch-up ladders (decode and verify shapes) and its
chain ladder next to the target's graphs; the drafts they produce equal the eager passes' (the same engine with
the draft graphs switched off, the same schedule), and greedy outputs with speculation equal those without. A second
round schedules oracle drafts (the reference continuation, spoiled at a cycling position) while the head still runs,
so verify steps keep 0..k drafts and the catch-up graphs see every per-row kept length.
Run through scripts/gpu/test.sh or `pytest tests/gpu/test_spec_graphs_gpu.py`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parents[1] / "spec_decode"))

from checkpoints import make_checkpoint  # noqa: E402
from eagle3_checkpoints import make_eagle3_draft  # noqa: E402
from mtp_checkpoints import make_deepseek_mtp_checkpoint  # noqa: E402
from spec_testutil import OracleDrafts, record_drafts  # noqa: E402
from gyrfalcon import LLM, SamplingParams  # noqa: E402

BATCHES = (1, 3, 8)
MAX_TOKENS = 24
KW = dict(dtype="float32", max_model_len=256, max_num_seqs=8, num_gpu_blocks_override=256,
          enable_prefix_caching=False)
# Drafts of the graphs and of the eager passes come from differently tiled kernels (padded batches, a full-width
# block table, all 1 + k positions of a verify row as queries): fp32 sums in another order. A draft flips only where
# the draft's two best logits are within that rounding (~1e-6 relative), which random heads with sharp logits
# almost never have; allow a sliver of such near-ties, never more.
MAX_FLIPPED = 0.01


def _prompts():
    g = torch.Generator().manual_seed(0)
    lens = [5, 37, 12, 60, 9, 23, 44, 17]
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lens]


@pytest.fixture(scope="module")
def setups(tmp_path_factory):
    """{method: (target path, speculative_config without k, {batch size: greedy outputs without speculation})}."""
    tmp = tmp_path_factory.mktemp("specgraphs")
    llama = make_checkpoint(tmp / "llama", "llama", num_hidden_layers=4)
    head = make_eagle3_draft(tmp / "head", llama, "speculators", aux_ids=[1, 2, 3], draft_vocab=300)
    ds = make_deepseek_mtp_checkpoint(tmp / "ds" / "t")
    out = {}
    for method, path, spec in (("eagle3", llama, {"method": "eagle3", "model": str(head)}),
                               ("mtp", ds, {"method": "mtp"})):
        llm = LLM(str(path), **KW)
        out[method] = (path, spec, {b: _greedy(llm, b) for b in BATCHES})
        del llm
        import gc
        gc.collect()
        torch.cuda.empty_cache()
    return out


def _greedy(llm, b):
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in _prompts()[:b]], sp,
                                                         use_tqdm=False)]


def _flipped(a, b):
    """Drafts of `a` (graph) that differ from `b`'s (eager) after the same sequence, plus those whose sequence `b`
    never drafted after (a flipped draft that a verify step would have kept changes the later steps)."""
    da, db = {tuple(t): d for t, d in a}, {tuple(t): d for t, d in b}
    common = da.keys() & db.keys()
    return sum(da[t] != db[t] for t in common) + len(da) - len(common)


def _oracle(refs, k):
    return OracleDrafts(_prompts(), refs, k, lambda d: d - 1 if d > 0 else 1)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_graph_drafts_equal_eager_drafts(setups, method, k):
    path, spec, refs = setups[method]
    llm = LLM(str(path), **KW, speculative_config={**spec, "num_speculative_tokens": k})
    runner = llm.engine.runner
    prop = runner.proposer
    g = prop.graphs
    assert runner.graph_runner is not None and g is not None
    assert set(g.catch_up_graphs) == {(b, q) for q in (1, 1 + k) for b in g.sizes_by_q[q]}
    assert set(g.chain_graphs) == (set(g.sizes) if k > 1 else set())
    replays = []
    catch_up, chain = g.catch_up, g.chain
    g.catch_up = lambda e, aux, q: replays.append(("catch_up", q)) or catch_up(e, aux, q)
    g.chain = lambda e, tok, h: replays.append(("chain",)) or chain(e, tok, h)
    seen = record_drafts(llm)

    def both_ways(run):
        """run() with the draft graphs, then with the eager passes: (outputs, drafts) of each."""
        n0 = len(seen)
        prop.use_graphs(g)
        graphed = run()
        n1 = len(seen)
        prop.use_graphs(None)
        try:
            eager = run()
        finally:
            prop.use_graphs(g)
        return graphed, eager, seen[n0:n1], seen[n1:]

    total = flipped = 0
    for b in BATCHES:
        graphed, eager, dg, de = both_ways(lambda: _greedy(llm, b))
        assert graphed == refs[b], b  # lossless with graph drafts
        assert eager == refs[b], b
        flipped += _flipped(dg, de)
        total += len(dg)
    # Oracle-scheduled drafts (the head still drafts and is recorded): partial acceptance at every depth.
    head = prop.propose
    oracle = _oracle(refs[8], k)

    def propose(rows, sampled):
        head(rows, sampled)
        return oracle.propose(rows, sampled)
    prop.propose = propose
    try:
        accepted0, drafted0 = llm.engine.spec_stats.num_accepted_tokens, llm.engine.spec_stats.num_draft_tokens
        graphed, eager, dg, de = both_ways(lambda: _greedy(llm, 8))
    finally:
        prop.propose = head
    s = llm.engine.spec_stats
    assert 0 < s.num_accepted_tokens - accepted0 < s.num_draft_tokens - drafted0
    assert graphed == eager == refs[8]
    flipped += _flipped(dg, de)
    total += len(dg)
    assert total > 0 and flipped <= MAX_FLIPPED * total, (flipped, total)
    # The graphs ran: verify-shaped catch-ups, and the chain after the prefills' eager catch-up.
    assert ("catch_up", 1 + k) in replays, replays
    assert k == 1 or ("chain",) in replays, replays


def test_enforce_eager_keeps_the_draft_eager(setups):
    path, spec, refs = setups["eagle3"]
    llm = LLM(str(path), **{**KW, "enforce_eager": True}, speculative_config={**spec, "num_speculative_tokens": 3})
    assert llm.engine.runner.graph_runner is None and llm.engine.runner.proposer.graphs is None
    assert _greedy(llm, 3) == refs[3]
