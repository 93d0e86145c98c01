"""The draft's passes through DraftGraphRunner (spec_decode/draft_graph.py): on a CPU its catch-up and chain steps run
eagerly over the padded static inputs the CUDA graphs capture, so these tests hold the padding (rows to the ladder's
size: slot -1, seq_len 0), the in-graph gathers (each row's last kept position, the chained argmax -> embedding) and
the rejected positions' slots against the proposer's eager path: the same drafts at every step, the same draft K/V
in the cache, and greedy outputs equal to the engine's without speculation; the target's prefills through the mixed
graphs' static path (their aux hidden states included). EAGLE-3 (a random head on a 4-layer
Llama), DeepSeek-V3 MTP and Qwen3-Next MTP. tests/gpu/test_spec_graphs_gpu.py runs the captured graphs."""

from __future__ import annotations

import pytest
import torch

from checkpoints import make_checkpoint
from eagle3_checkpoints import make_eagle3_draft
from mtp_checkpoints import make_deepseek_mtp_checkpoint, make_qwen3_next_mtp_checkpoint
from gyrfalcon import LLM, SamplingParams
from gyrfalcon.runner.cuda_graph import CudaGraphRunner
from gyrfalcon.runner.mixed_graph import MixedGraphRunner
from spec_testutil import OracleDrafts, record_drafts

PROMPTS = [[5, 9, 13, 2, 7, 5, 9, 13], [11, 4, 4, 8, 30, 6, 1, 3, 17], [21, 3, 21, 3, 21]]
MAX_NUM_SEQS = 6  # ladder 1, 2, 4, 8: three requests replay size 4 (one padding row)
KW = dict(device="cpu", block_size=4, max_model_len=96, max_num_seqs=MAX_NUM_SEQS, enable_prefix_caching=True)


@pytest.fixture(scope="module")
def llama_target(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama4"), "llama", num_hidden_layers=4)


@pytest.fixture(scope="module")
def eagle_head(llama_target, tmp_path_factory):
    return make_eagle3_draft(tmp_path_factory.mktemp("head"), llama_target, "speculators", aux_ids=[1, 2, 3],
                             draft_vocab=300)


@pytest.fixture(scope="module")
def ds_mtp(tmp_path_factory):
    return make_deepseek_mtp_checkpoint(tmp_path_factory.mktemp("dsmtp") / "t")


def _oracle(refs, k):
    return OracleDrafts(PROMPTS, refs, k, lambda d: d - 1 if d > 0 else 1)


def _run(path, spec, graphs: bool, budget: int, target_graphs: bool = False, refs=None):
    """Two rounds of greedy generation (the second from prefix-cache hits) plus a max_tokens=2 round (its second
    step is a decode step of every row: the q = 1 catch-up); refs: the outputs without speculation, for the
    _oracle's drafts. Returns (outputs, the head's drafts seen, the draft's K/V caches, the DraftGraphRunner's
    calls)."""
    llm = LLM(str(path), max_num_batched_tokens=budget, **KW, **({"speculative_config": spec} if spec else {}))
    r = llm.engine.runner
    calls = []
    if graphs:
        g = r.proposer.make_graph_runner(MAX_NUM_SEQS, KW["max_model_len"])
        catch_up, chain = g.catch_up, g.chain
        g.catch_up = lambda entries, aux, q: calls.append(("catch_up", q, len(entries))) or catch_up(entries, aux, q)
        g.chain = lambda entries, tok, h: calls.append(("chain", len(entries))) or chain(entries, tok, h)
        r.proposer.use_graphs(g)
    if target_graphs:  # the target's decode / verify steps, and its prefills, through its own static inputs as well
        k = spec["num_speculative_tokens"]
        r.graph_runner = CudaGraphRunner(r.model, r.kv_caches, MAX_NUM_SEQS, KW["max_model_len"], r.block_size,
                                         r.device, r.last_sampled, query_lens=(1, 1 + k))
        m = MixedGraphRunner(r.model, r.kv_caches, budget, MAX_NUM_SEQS, KW["max_model_len"], r.block_size,
                             r.device, r.last_sampled)
        mixed_run = m.run
        m.run = lambda hb: calls.append(("mixed", hb.num_tokens)) or mixed_run(hb)
        r.mixed_graph_runner = m
    seen = record_drafts(llm) if spec else []
    if refs is not None:
        head, oracle = r.proposer.propose, _oracle(refs, spec["num_speculative_tokens"])

        def propose(rows, sampled):
            head(rows, sampled)  # (recorded)
            return oracle.propose(rows, sampled)
        r.proposer.propose = propose
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outs = []
    for max_tokens in (10, 10, 2):
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)])
    caches = []
    if spec:
        for idx in r.proposer.cache_specs("float32"):
            c = r.kv_caches[idx]
            caches.extend(t.clone() for t in (c if isinstance(c, (tuple, list)) else (c,)))
    if refs is not None:  # verify steps kept some drafts and rejected others
        s = llm.engine.spec_stats
        assert 0 < s.num_accepted_tokens < s.num_draft_tokens
    return outs, seen, caches, calls


def _check(path, spec, budget, target_graphs=True):
    k = spec["num_speculative_tokens"]
    ref, _, _, _ = _run(path, None, False, budget)
    eager, eager_seen, eager_kv, _ = _run(path, spec, False, budget, refs=ref[0])
    graphed, seen, kv, calls = _run(path, spec, True, budget, target_graphs=target_graphs, refs=ref[0])
    assert graphed == eager == ref
    assert seen == eager_seen and len(seen) > 3 * len(PROMPTS)
    # The draft's K/V of every position is what the eager passes wrote (rejected positions left alone, padding
    # rows writing nothing).
    assert len(kv) == len(eager_kv) > 0
    for a, b in zip(kv, eager_kv):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # Each path ran: the catch-up of a verify step (1 + k) and of a decode step (1), padded (3 rows -> 4), and the
    # chain after an eager (prefill) catch-up.
    qs = {c[1] for c in calls if c[0] == "catch_up"}
    assert {1, 1 + k} <= qs, calls
    assert any(c[0] == "chain" for c in calls) or k == 1, calls
    assert any(c[0] == "catch_up" and c[2] == 3 for c in calls)
    # The target's prefill steps went through the mixed graphs' static path, which hands the draft every token's
    # aux hidden states.
    assert any(c[0] == "mixed" for c in calls) or not target_graphs, calls


def test_eagle3_draft_graphs_match_the_eager_passes(llama_target, eagle_head):
    """k = 3 (a chain of two passes), prefills chunked to 7 tokens (eager catch-ups, then the chain)."""
    _check(llama_target, {"method": "eagle3", "model": str(eagle_head), "num_speculative_tokens": 3}, 7)


def test_mtp_draft_graphs_match_the_eager_passes(ds_mtp):
    """k = 1: the catch-up alone (no chain)."""
    _check(ds_mtp, {"method": "mtp", "num_speculative_tokens": 1}, 64)


def test_qwen3_next_mtp_draft_graphs_match_the_eager_passes(tmp_path):
    """k = 2 (a chain of one pass) over a hybrid target, whose verify steps stay eager (the linear-attention state
    rollback tracks tokens on the host); the draft's MTP layer is gated full attention."""
    path = make_qwen3_next_mtp_checkpoint(tmp_path / "qn")
    _check(path, {"method": "mtp", "num_speculative_tokens": 2}, 64, target_graphs=False)


def test_a_batch_past_the_ladder_runs_eagerly(llama_target, eagle_head):
    """More proposing rows than the largest captured size: the chain and catch-up fall back to the eager passes."""
    llm = LLM(str(llama_target), max_num_batched_tokens=64, **KW,
              speculative_config={"method": "eagle3", "model": str(eagle_head), "num_speculative_tokens": 2})
    r = llm.engine.runner
    g = r.proposer.make_graph_runner(2, KW["max_model_len"])  # ladder 1, 2
    r.proposer.use_graphs(g)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp,
                                                        use_tqdm=False)]
    r.proposer.use_graphs(None)
    want = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp,
                                                         use_tqdm=False)]
    assert got == want
