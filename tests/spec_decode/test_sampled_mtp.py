"""Sampled requests under MTP speculation: the drafts come from the target's own MTP layer (a tiny DeepSeek-V3
checkpoint over a 16-token vocabulary, spec_decode/mtp.py), run through the draft graphs' static-input path
(spec_decode/draft_graph.py; on a CPU its steps run eagerly), and the verify step's rows must have the per-position
token distributions of generation without drafts. test_sampled.py's two-sample chi-square test and its bound (whose
power that file shows on a temperature change of 1.0 to 1.25), here with real draft-model proposals instead of
scripted ones."""

from __future__ import annotations

import pytest

from mtp_checkpoints import make_deepseek_mtp_checkpoint
from gyrfalcon import LLM, SamplingParams
from test_sampled import MAX_TOKENS, N, P_BOUND, PROMPT, VOCAB, _per_position_p

K = 2
KW = dict(device="cpu", block_size=4, max_num_seqs=512, max_num_batched_tokens=4096, max_model_len=64)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """(the engine without drafts, the engine with MTP drafts through the draft graphs' path)."""
    path = make_deepseek_mtp_checkpoint(tmp_path_factory.mktemp("dsmtp16") / "t", vocab_size=VOCAB)
    plain = LLM(str(path), **KW)
    spec = LLM(str(path), **KW, speculative_config={"method": "mtp", "num_speculative_tokens": K})
    prop = spec.engine.runner.proposer
    prop.use_graphs(prop.make_graph_runner(KW["max_num_seqs"], KW["max_model_len"]))
    return plain, spec


def _generate(llm, params):
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * N, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_mtp_sampled_distributions_match_without_speculation(engines):
    """Temperature 1 (test_sampled.py covers top-k / top-p and penalties on verify rows with scripted drafts)."""
    plain_llm, spec_llm = engines
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = _generate(plain_llm, params)
    stats = spec_llm.engine.spec_stats
    drafts0, accepted0 = stats.num_draft_tokens, stats.num_accepted_tokens
    spec = _generate(spec_llm, params)
    drafted, accepted = stats.num_draft_tokens - drafts0, stats.num_accepted_tokens - accepted0
    # Rows after kept drafts are among those tested: a random MTP layer's greedy draft is kept with the target's
    # probability of it (~1/16 on this vocabulary; 3.6% of 4440 drafts at N = 1500 here), deterministic for a
    # given N (the engine's seed fixes the unseeded streams).
    assert accepted > 0.02 * drafted > 0, (accepted, drafted)
    ps = _per_position_p(plain, spec)
    assert min(ps) > P_BOUND, ps
