"""The ngram (prompt lookup) proposer: the lookup itself, and through the engine greedy outputs identical to
transformers' (hence to no speculation) at k = 1..4 with chunked prefill, prefix caching, async scheduling,
preemption and aborts; acceptance counted (LLM.get_metrics) and > 0 where the text repeats."""

from __future__ import annotations

import numpy as np
import pytest

from gyrfalcon import LLM, SamplingParams
from gyrfalcon.spec_decode.ngram import ngram_lookup
from test_model_parity import hf_refs  # noqa: F401
from test_model_parity import test_greedy_parity as greedy_parity
from test_model_parity import test_greedy_parity_under_preemption as greedy_parity_under_preemption


def _spec(k, lo=1, hi=3):
    return {"speculative_config": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lo,
                                   "prompt_lookup_max": hi}}


def _metrics(llm):
    return {m.name: (m.values if hasattr(m, "values") else m.value) for m in llm.get_metrics()}


@pytest.mark.parametrize("tokens,k,lo,hi,want", [
    ([1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 7, 8, 1, 2, 3], 3, 1, 4, [4, 7, 8]),  # the latest match of the longest n
    ([1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 7, 8, 1, 2, 3], 3, 4, 4, []),  # no 4-gram repeats
    ([7, 1, 2, 9, 9, 3, 1, 2], 2, 2, 3, [9, 9]),  # 3-gram (7?) fails, the 2-gram [1, 2] matches
    ([5, 6, 7], 3, 1, 3, []),  # nothing repeats
    ([5, 5, 5, 5], 3, 1, 3, [5]),  # what follows the match ends at the sequence's end
    ([4, 8, 4], 5, 1, 1, [8, 4]),
])
def test_ngram_lookup(tokens, k, lo, hi, want):
    assert ngram_lookup(np.array(tokens, dtype=np.int64), k, lo, hi) == want


def _brute_force_lookup(t, k, lo, hi):
    """The definition, one n-gram at a time: the longest n first, then its latest earlier occurrence."""
    L = len(t)
    for n in range(min(hi, L - 1), lo - 1, -1):
        suffix = list(t[L - n:])
        for s in range(L - n - 1, -1, -1):
            if list(t[s:s + n]) == suffix:
                return list(t[s + n:s + n + k])
    return []


def test_ngram_lookup_matches_the_definition_on_random_sequences():
    rng = np.random.default_rng(0)
    for _ in range(2000):
        t = rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(1, 40)))
        lo = int(rng.integers(1, 4))
        hi, k = lo + int(rng.integers(0, 4)), int(rng.integers(1, 5))
        assert ngram_lookup(t, k, lo, hi) == _brute_force_lookup(t, k, lo, hi), (t.tolist(), k, lo, hi)


def _check_metrics(llm):
    m = _metrics(llm)
    k = llm.config.speculative_config.num_speculative_tokens
    drafts, draft_tokens = m["gyrfalcon:spec_decode_num_drafts"], m["gyrfalcon:spec_decode_num_draft_tokens"]
    accepted = m["gyrfalcon:spec_decode_num_accepted_tokens"]
    per_pos = m["gyrfalcon:spec_decode_num_accepted_tokens_per_pos"]
    assert drafts > 0 and drafts <= draft_tokens <= k * drafts
    assert sum(per_pos) == accepted and len(per_pos) <= k
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))  # position j needs 0..j-1 accepted
    assert accepted > 0  # verify steps kept drafts (the tiny models repeat themselves): not only rejections ran


# k = 1..4, each with another mix of the engine's features (the dense families' full cross-product runs without
# drafts in tests/models/test_model_parity.py).
@pytest.mark.parametrize("k,prefix_caching,budget,async_scheduling", [
    (1, True, 7, True), (2, False, None, False), (3, True, None, False), (4, False, 7, True)],
    ids=["k1-prefix-chunked-async", "k2-plain-sync", "k3-prefix", "k4-chunked-async"])
def test_greedy_parity_with_ngram(tiny_ckpt, hf_refs, k, prefix_caching, budget, async_scheduling):  # noqa: F811
    greedy_parity(tiny_ckpt, hf_refs, prefix_caching, budget, async_scheduling, llm_kw=_spec(k),
                       check=_check_metrics)


def test_greedy_parity_with_ngram_under_preemption(tiny_ckpt, hf_refs):  # noqa: F811
    greedy_parity_under_preemption(tiny_ckpt, hf_refs, True, True, llm_kw=_spec(3), check=_check_metrics)


@pytest.fixture(scope="module")
def ngram_llm(llama_ckpt):
    return LLM(str(llama_ckpt), max_model_len=256, block_size=4, max_num_batched_tokens=32, device="cpu",
               **_spec(3, 1, 4))


def test_acceptance_on_a_repetitive_prompt(ngram_llm, llama_ckpt):
    """A prompt that repeats one span: the model continues it (a tiny random model copies what its context
    repeats often enough), and the lookup proposes exactly that, so drafts get accepted; outputs equal those of
    the same engine without speculation."""
    span = [11, 42, 7, 99, 3, 58, 21, 64]
    prompt = span * 6
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got = ngram_llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs[0].token_ids
    plain = LLM(str(llama_ckpt), max_model_len=256, block_size=4, max_num_batched_tokens=32, device="cpu")
    assert got == plain.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs[0].token_ids
    m = _metrics(ngram_llm)
    assert m["gyrfalcon:spec_decode_num_accepted_tokens"] > 0
    assert m["gyrfalcon:spec_decode_num_accepted_tokens_per_pos"][0] > 0
    assert "gyrfalcon:spec_decode_num_drafts" not in _metrics(plain)


def test_abort_mid_generation_frees_everything(ngram_llm):
    """Requests with drafts in flight, one aborted after a few steps: the others finish with the tokens they
    get alone, and every block comes back."""
    eng = ngram_llm.engine
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [[3, 4, 5, 3, 4, 5, 3, 4], [9, 8, 9, 8, 9, 8], [1, 2, 1, 2, 1, 2, 1]]
    alone = [o.outputs[0].token_ids for o in ngram_llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                                                use_tqdm=False)]
    drafts_before = eng.spec_stats.num_drafts
    for i, p in enumerate(prompts):
        eng.add_request(f"a{i}", p, sp)
    out = {f"a{i}": [] for i in range(len(prompts))}
    for step in range(40):
        if step == 3:
            assert eng.abort_request("a1")
        for u in eng.step():
            out[u.request_id].extend(u.new_token_ids)
        if not eng.has_unfinished_requests():
            break
    assert not eng.has_unfinished_requests()
    assert out["a0"] == alone[0] and out["a2"] == alone[2]
    assert len(out["a1"]) < len(alone[1])
    assert eng.spec_stats.num_drafts > drafts_before
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(c == 0 for c in bm.ref_cnt)
