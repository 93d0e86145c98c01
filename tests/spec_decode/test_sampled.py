"""Sampled requests under speculation (ModelRunner.complete's argument): seeded requests give exactly the tokens
they give without drafts, penalties and min_tokens included (each verify row counts the drafts ahead of it);
unseeded ones the same per-position token distributions, by a two-sample chi-square test over many samples on a
16-token vocabulary (temperature, top-k / top-p, penalties), whose power is shown on a small temperature change."""

from __future__ import annotations

import pytest
from scipy.stats import chi2

from checkpoints import make_checkpoint
from gyrfalcon import LLM, SamplingParams

VOCAB, K, N, MAX_TOKENS = 16, 3, 1500, 4
PROMPT = [3, 7, 1, 12, 5, 3, 7]


class _Scripted:
    """Drafts the next K tokens of a fixed continuation per prompt (the likely path: drafts get accepted often), or
    of a corrupted copy from position `wrong_from` on."""

    def __init__(self, conts, wrong_from=None):
        self.conts, self.wrong_from = conts, wrong_from

    def propose(self, rows, sampled):
        out = []
        for r, toks in zip(rows, sampled):
            st = r.request
            cont = self.conts[tuple(st.prompt_token_ids)]
            n = st.num_output_tokens
            d = list(cont[n:n + K]) if toks else []
            if self.wrong_from is not None:
                d = d[:self.wrong_from] + [(t + 1) % VOCAB for t in d[self.wrong_from:]]
            out.append(d)
        return out


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("v16"), "llama", vocab_size=VOCAB)
    return LLM(str(path), device="cpu", block_size=4, max_num_seqs=512, max_num_batched_tokens=4096,
               max_model_len=64)


def _generate(llm, prompts, params, proposer=None):
    runner = llm.engine.runner
    runner.proposer = proposer
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        runner.proposer = None
    return [o.outputs[0].token_ids for o in outs]


PENALTIES = dict(presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.3, min_tokens=3)


@pytest.mark.parametrize("wrong_from", [None, 1], ids=["right-drafts", "wrong-from-1"])
def test_seeded_requests_are_reproduced_exactly(llm, wrong_from):
    prompts = [PROMPT, [9, 9, 9, 2], [4, 11, 6, 0, 15, 8]]
    params = [SamplingParams(temperature=0.9, seed=11 + i, max_tokens=10, **PENALTIES) for i in range(3)] + \
             [SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=3, max_tokens=10, min_tokens=4)]
    prompts = prompts + [PROMPT]
    ref = [_generate(llm, [p], sp)[0] for p, sp in zip(prompts, params)]
    conts = {}
    for p, r in zip(prompts, ref):
        conts.setdefault(tuple(p), r)
    stats = llm.engine.spec_stats
    accepted0 = stats.num_accepted_tokens
    got = [_generate(llm, [p], sp, _Scripted(conts, wrong_from))[0] for p, sp in zip(prompts, params)]
    assert got == ref
    if wrong_from is None:
        assert stats.num_accepted_tokens > accepted0  # drafts were kept: rows after them sampled with them counted


def _two_sample_p(a, b):
    """p-value of the two-sample chi-square test that token lists a and b (same size) come from one distribution."""
    bins = sorted(set(a) | set(b))
    ca = {t: 0 for t in bins}
    cb = dict(ca)
    for t in a:
        ca[t] += 1
    for t in b:
        cb[t] += 1
    stat = sum((ca[t] - cb[t]) ** 2 / (ca[t] + cb[t]) for t in bins)
    return chi2.sf(stat, max(len(bins) - 1, 1))


def _per_position_p(xs, ys):
    return [_two_sample_p([x[i] for x in xs], [y[i] for y in ys]) for i in range(MAX_TOKENS)]


# Strong enough that a verify row blind to the drafts ahead of it would repeat them visibly more often.
STRONG_PENALTIES = dict(presence_penalty=2.0, frequency_penalty=2.0, repetition_penalty=2.0, min_tokens=3)
# Deterministic (the engine's seed fixes the unseeded streams): a bound of 1e-4 per position, four positions.
P_BOUND = 1e-4


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=6, top_p=0.85, max_tokens=MAX_TOKENS, ignore_eos=True),
    SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, **STRONG_PENALTIES)],
    ids=["temperature", "top-k-top-p", "penalties-min-tokens"])
def test_unseeded_distributions_match_without_speculation(llm, params):
    greedy = _generate(llm, [PROMPT], SamplingParams(temperature=0, max_tokens=MAX_TOKENS + K, ignore_eos=True))[0]
    plain = _generate(llm, [PROMPT] * N, params)
    stats = llm.engine.spec_stats
    drafts0, accepted0 = stats.num_draft_tokens, stats.num_accepted_tokens
    spec = _generate(llm, [PROMPT] * N, params, _Scripted({tuple(PROMPT): greedy}))
    drafted, accepted = stats.num_draft_tokens - drafts0, stats.num_accepted_tokens - accepted0
    assert accepted > 0.05 * drafted > 0  # verify steps kept drafts often: their rows' distributions are tested
    ps = _per_position_p(plain, spec)
    assert min(ps) > P_BOUND, ps


def test_the_chi_square_bound_detects_a_small_shift(llm):
    """Power: the same bound rejects samples drawn at temperature 1.0 against 1.25 (no speculation)."""
    a = _generate(llm, [PROMPT] * N, SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    b = _generate(llm, [PROMPT] * N, SamplingParams(temperature=1.25, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert min(_per_position_p(a, b)) < P_BOUND


def test_stops_and_logprobs_inside_a_verify_step(llm):
    """A stop token that lands among accepted drafts ends the request there (no token after it is emitted), and
    every emitted token's logprobs are those of one-token steps."""
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    cont = _generate(llm, [PROMPT], greedy)[0]
    i = next(j for j in range(2, len(cont)) if cont[j] not in cont[:j])  # a stop token first emitted at j > 1
    stop = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[cont[i]], logprobs=2)
    runner = llm.engine.runner
    ref = llm.generate([{"prompt_token_ids": PROMPT}], stop, use_tqdm=False)[0].outputs[0]
    runner.proposer = _Scripted({tuple(PROMPT): cont})
    accepted0 = llm.engine.spec_stats.num_accepted_tokens
    try:
        got = llm.generate([{"prompt_token_ids": PROMPT}], stop, use_tqdm=False)[0].outputs[0]
    finally:
        runner.proposer = None
    assert llm.engine.spec_stats.num_accepted_tokens > accepted0
    assert got.token_ids == ref.token_ids == cont[:i + 1]
    assert (got.finish_reason, got.stop_reason) == ("stop", cont[i]) == (ref.finish_reason, ref.stop_reason)
    assert len(got.logprobs) == len(ref.logprobs) == i + 1
    for a, b in zip(got.logprobs, ref.logprobs):
        assert a.keys() == b.keys()
        for t in a:
            assert abs(a[t].logprob - b[t].logprob) < 1e-4 and a[t].rank == b[t].rank
