"""Steps where a sequence carries 1 + k tokens (k = 0..4: the verify step of speculative decoding): the same
logits as running the tokens one at a time, and through the whole engine the same outputs as without drafts,
whether the drafts are right, wrong or partly right (rejected drafts roll back)."""

from __future__ import annotations

import pytest
import torch

from gyrfalcon import LLM, SamplingParams
from gyrfalcon.engine.request import Request
from gyrfalcon.forward_context import forward_context
from gyrfalcon.runner.forward_batch import build_forward_batch
from checkpoints import step_row

PROMPTS = [[5, 9, 13, 2, 7], [11, 4, 4, 8, 30, 6, 1, 3, 17], [21, 3], [8] * 13, [40, 41, 42, 43]]


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def llm(request, qwen3_ckpt, llama_ckpt):
    path = qwen3_ckpt if request.param == "qwen3" else llama_ckpt
    return LLM(str(path), max_model_len=128, block_size=4, max_num_batched_tokens=64, device="cpu")


def _run(runner, rows):
    fb = build_forward_batch(rows, runner.block_size, runner.device)
    with torch.inference_mode(), forward_context(fb, runner.kv_caches):
        logits = runner.model.compute_logits(runner.model(fb.input_ids, fb.positions))
    for r in rows:
        r.request.num_computed_tokens += r.num_new_tokens
    return logits, fb


def test_verify_step_logits_match_one_token_at_a_time(llm):
    """Sequence i carries 1 + k_i tokens (k_i = 0..4) in one step; each row's logits equal those of the same
    token run alone, one step per token, in a second copy of the cache blocks."""
    runner, bm = llm.engine.runner, llm.engine.block_manager
    greedy = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                          SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    conts = [o.outputs[0].token_ids for o in greedy]
    ks = [0, 1, 2, 3, 4]

    def fresh(tag):
        reqs = []
        for i, p in enumerate(PROMPTS):
            r = Request(f"{tag}{i}", p, SamplingParams(max_tokens=8))
            r.output_token_ids = [conts[i][0]]  # the prompt's first sampled token, then k drafts
            assert bm.allocate_slots(r, r.num_tokens + ks[i])
            reqs.append(r)
        _run(runner, [step_row(r, r.num_prompt_tokens, False, 0) for r in reqs])  # prefill the prompts
        return reqs

    # One step: token + k drafts per sequence, every row sampled.
    reqs = fresh("v")
    rows = [step_row(r, 1 + k, True, r.num_computed_tokens, list(conts[i][1:1 + k]))
            for i, (r, k) in enumerate(zip(reqs, ks))]
    logits, fb = _run(runner, rows)
    assert fb.uniform_query_len == 0 and fb.logits_indices.numel() == sum(1 + k for k in ks)
    got = logits[fb.logits_indices]
    # The same tokens one at a time.
    ref_reqs = fresh("s")
    want = [[] for _ in PROMPTS]
    for j in range(max(ks) + 1):
        live = [(i, r) for i, r in enumerate(ref_reqs) if j <= ks[i]]
        for i, r in live:
            if j:
                r.output_token_ids.append(conts[i][j])
        step, _ = _run(runner, [step_row(r, 1, True, r.num_computed_tokens) for _, r in live])
        for (i, _), row in zip(live, step):
            want[i].append(row)
    want = torch.stack([row for w in want for row in w])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for r in reqs + ref_reqs:
        bm.free(r)


class _Proposer:
    """Drafts for each request's next step from a known continuation, optionally corrupted."""

    def __init__(self, conts, k, wrong_from=None, vocab=100):
        self.conts, self.k, self.wrong_from, self.vocab = conts, k, wrong_from, vocab
        self.num_proposed = 0

    def propose(self, rows, sampled):
        out = []
        for r in rows:
            st = r.request
            cont = self.conts[tuple(st.prompt_token_ids)]
            n = st.num_output_tokens
            d = list(cont[n:n + self.k])
            if self.wrong_from is not None:
                d = d[:self.wrong_from] + [(t + 1) % self.vocab for t in d[self.wrong_from:]]
            self.num_proposed += len(d)
            out.append(d)
        return out


@pytest.mark.parametrize("k,wrong_from", [(1, None), (4, None), (3, 0), (4, 2)])
@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                    SamplingParams(temperature=0.9, seed=7, max_tokens=12, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_engine_outputs_unchanged_by_drafts(llm, k, wrong_from, params):
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    ref = llm.generate(prompts, params, use_tqdm=False)
    conts = {tuple(p): o.outputs[0].token_ids for p, o in zip(PROMPTS, ref)}
    runner = llm.engine.runner
    runner.proposer = _Proposer(conts, k, wrong_from)
    try:
        got = llm.generate(prompts, params, use_tqdm=False)
    finally:
        proposed = runner.proposer.num_proposed
        runner.proposer = None
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert proposed > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("k", [1, 3])
def test_verify_steps_replay_graphs_keyed_by_query_length(qwen3_ckpt, k):
    """With num_speculative_tokens = k the graph runner holds a ladder of (b * (1 + k), 1 + k) graphs beside the
    one-token ladder; verify steps of uniform length take it (on a CPU the padded step runs eagerly, checking
    its static inputs), and the outputs equal those without drafts."""
    from gyrfalcon.runner.cuda_graph import CudaGraphRunner

    kw = dict(block_size=4, max_model_len=128, max_num_batched_tokens=64, max_num_seqs=6, device="cpu")
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(str(qwen3_ckpt), **kw)
    ref = llm.generate(prompts, params, use_tqdm=False)
    conts = {tuple(p): o.outputs[0].token_ids for p, o in zip(PROMPTS, ref)}
    r = llm.engine.runner
    r.graph_runner = CudaGraphRunner(r.model, r.kv_caches, 6, 128, r.block_size, r.device, r.last_sampled,
                                     query_lens=(1, 1 + k))
    assert sorted(r.graph_runner.sizes_by_q) == [1, 1 + k]
    seen = []
    forward = r.graph_runner._forward
    r.graph_runner._forward = lambda fb, src: seen.append((fb.uniform_query_len, fb.num_tokens)) or forward(fb, src)
    r.proposer = _Proposer(conts, k, wrong_from=1 if k > 1 else None)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    qs = {q for q, _ in seen}
    assert 1 + k in qs, seen  # verify steps replayed their own ladder
    assert all(n % q == 0 for q, n in seen)
