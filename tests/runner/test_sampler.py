"""Sampler semantics: allowed sets of top-k / top-p / min-p, penalties, seeds, logprobs."""

from __future__ import annotations

import pytest
import torch

from gyrfalcon.runner.sampler import Sampler, SamplingMetadata, apply_penalties, apply_top_k_top_p_min_p

V = 50


def md_for(S, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seeds=None, offsets=None, **kw):
    """seeds default to 0 and offsets to the row index; pass offsets that change per draw."""
    t = torch.full((S,), float(temperature))
    return SamplingMetadata(
        temperature=t, top_p=torch.full((S,), float(top_p)), top_k=torch.full((S,), top_k, dtype=torch.int64),
        min_p=torch.full((S,), float(min_p)), all_greedy=temperature == 0, all_random=temperature > 0,
        need_top_p=top_p < 1, need_top_k=top_k > 0, need_min_p=min_p > 0,
        seeds=torch.zeros(S, dtype=torch.int64) if seeds is None else torch.as_tensor(seeds, dtype=torch.int64),
        offsets=torch.arange(S) if offsets is None else torch.as_tensor(offsets, dtype=torch.int64), **kw)


def allowed_set(logits_row, top_k=0, top_p=1.0, min_p=0.0):
    """Independent computation of the tokens a row may emit (ties avoided by the test data)."""
    probs = logits_row.softmax(-1)
    order = probs.argsort(descending=True).tolist()
    keep = set(order)
    if min_p > 0:
        keep &= {i for i in range(V) if probs[i] >= min_p * probs.max()}
    if top_k > 0:
        keep &= set(order[:top_k])
    if top_p < 1.0:
        # Renormalise over what survived so far (vLLM applies top-p after top-k), then keep the
        # smallest head whose mass reaches top_p.
        kept = [i for i in order if i in keep]
        mass = probs[kept] / probs[kept].sum()
        head, acc = set(), 0.0
        for i, m in zip(kept, mass.tolist()):
            head.add(i)
            acc += m
            if acc >= top_p:
                break
        keep &= head
    return keep


@pytest.mark.parametrize("top_k,top_p,min_p", [(5, 1.0, 0.0), (0, 0.7, 0.0), (0, 1.0, 0.2),
                                               (8, 0.8, 0.0), (10, 0.9, 0.05), (1, 1.0, 0.0)])
def test_sampling_never_leaves_allowed_set(top_k, top_p, min_p):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, V, generator=g) * 3
    allowed = [allowed_set(logits[i], top_k, top_p, min_p) for i in range(4)]
    sampler = Sampler()
    seen = [set() for _ in range(4)]
    for step in range(300):
        out = sampler(logits.clone(), md_for(4, 1.0, top_p, top_k, min_p, offsets=torch.arange(4) + 4 * step))
        for i, t in enumerate(out.sampled.tolist()):
            assert t in allowed[i], (i, t, sorted(allowed[i]))
            seen[i].add(t)
    # The draw is random within the set, not stuck on the argmax (unless the set is one token).
    for i in range(4):
        assert len(allowed[i]) == 1 or len(seen[i]) > 1


def test_top_k_top_p_mask_matches_independent_computation():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, V, generator=g) * 2
    masked = apply_top_k_top_p_min_p(logits.clone(), md_for(6, 1.0, 0.75, 12, 0.0))
    for i in range(6):
        got = set(torch.nonzero(masked[i] > float("-inf")).flatten().tolist())
        assert got == allowed_set(logits[i], 12, 0.75, 0.0)


def test_greedy_is_argmax_and_temperature_zero_rows_mix():
    logits = torch.randn(3, V)
    md = md_for(3, 1.0)
    md.temperature = torch.tensor([0.0, 1.0, 0.0])
    md.all_random = False
    out = Sampler()(logits.clone(), md)
    assert out.sampled[0] == logits[0].argmax() and out.sampled[2] == logits[2].argmax()


def test_seeded_rows_do_not_depend_on_batch_composition():
    torch.manual_seed(0)
    target = torch.randn(V) * 2

    def draw(batch_rows, pos):
        logits = torch.stack(batch_rows)
        seq = []
        for step in range(20):
            # The other rows draw from another stream (unseeded rows: this step's, one offset per row).
            seeds = [99 + step] * len(batch_rows)
            offsets = list(range(len(batch_rows)))
            seeds[pos], offsets[pos] = 1234, step  # the seeded row: its seed and its output index
            md = md_for(len(batch_rows), 0.9, seeds=seeds, offsets=offsets)
            seq.append(Sampler()(logits.clone(), md).sampled[pos].item())
        return seq

    alone = draw([target], 0)
    crowded = draw([torch.randn(V), target, torch.randn(V), torch.randn(V)], 1)
    assert alone == crowded
    assert len(set(alone)) > 1


def test_penalties_change_logits_as_specified():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    md = md_for(1, 1.0)
    md.output_token_ids = [[0, 0, 1]]
    md.prompt_token_ids = [[3]]
    md.presence_penalty = torch.tensor([0.5])
    md.frequency_penalty = torch.tensor([0.25])
    md.repetition_penalty = torch.tensor([2.0])
    got = apply_penalties(logits.clone(), md)[0]
    # token 0: seen in output twice, positive -> /2, then -0.25*2, then -0.5
    # token 1: once, negative -> *2, then -0.25, then -0.5
    # token 3: prompt only -> repetition applies (/2), frequency/presence do not
    want = torch.tensor([2.0 / 2 - 0.5 - 0.5, -1.0 * 2 - 0.25 - 0.5, 0.5, 3.0 / 2, -2.0])
    torch.testing.assert_close(got, want)


def test_min_tokens_mask_and_logprobs_are_raw():
    logits = torch.tensor([[5.0, 1.0, 0.0, -1.0]])
    md = md_for(1, 0.0)
    md.min_tokens_mask = [[0]]
    md.max_num_logprobs = 2
    out = Sampler()(logits.clone(), md)
    assert out.sampled.item() == 1  # token 0 (the would-be eos) is masked
    raw = logits.log_softmax(-1)[0]
    torch.testing.assert_close(out.sampled_logprob, raw[1:2])
    assert out.sampled_rank.item() == 2
    assert out.top_ids[0].tolist() == [0, 1]
    torch.testing.assert_close(out.top_logprobs[0], raw[:2])


def test_unit_temperature_shortcut_draws_the_same_tokens():
    """unit_temperature (every row at 1.0) skips the division, and all_random the greedy argmax: the same
    tokens as the general path, which divides by 1.0 exactly."""
    logits = torch.randn(6, V) * 3
    seeds, offsets = [7] * 6, list(range(6))
    general = Sampler()(logits.clone(), md_for(6, 1.0, seeds=seeds, offsets=offsets))
    short = Sampler()(logits.clone(), md_for(6, 1.0, seeds=seeds, offsets=offsets, unit_temperature=True))
    assert torch.equal(general.sampled, short.sampled)


def test_runner_marks_unit_temperature(qwen3_ckpt):
    from gyrfalcon import LLM
    from gyrfalcon.sampling_params import SamplingParams

    llm = LLM(str(qwen3_ckpt), max_model_len=64, max_num_seqs=2)
    runner = llm.engine.runner
    seen = []
    build = runner._sampling_metadata
    runner._sampling_metadata = lambda reqs, *a: seen.append(build(reqs, *a).unit_temperature) or build(reqs, *a)
    prompt = [{"prompt_token_ids": [5, 6, 7]}]
    llm.generate(prompt, SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert seen and all(seen)
    seen.clear()
    llm.generate(prompt, SamplingParams(temperature=0.7, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert seen and not any(seen)
