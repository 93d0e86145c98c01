"""DeepSeek-V3.2 with a sparse indexer selection under speculative decoding: greedy outputs equal the runs without
drafts, at k = 1 and 2, with drafts that are always right and always wrong (every verify step keeps all or none).

The checkpoint is MODELS.md's tiny V3.2 (index_topk 4 against 5-9-token prompts plus 12 outputs, 4 index heads):
many keys score exactly 0 after the relu, so the top-k cut falls among ties in most rows. A verify step scores
each of its 1 + k rows over the whole context (-inf after the row's position), a one-token step over position + 1
columns: the selection must not depend on that layout (kernels/dsa_indexer select_topk). The Triton path (the
indexer scores + top-k, the sparse split-K MLA kernel's per-token rows, the fused preps) runs under the
interpreter once, at k = 2 with wrong drafts (the most verify steps)."""

from __future__ import annotations

import pytest

from checkpoints import make_deepseek_v32_checkpoint
from gyrfalcon import LLM, SamplingParams

PROMPTS = [[5, 9, 13, 2, 7, 5, 9, 13, 2], [11, 4, 4, 8, 30, 6, 1, 3, 17], [21, 3, 21, 3, 21]]
MAX_NEW = 12
KW = dict(device="cpu", block_size=4, max_model_len=64, max_num_batched_tokens=8)


class _Scripted:
    """Drafts the next k tokens of each prompt's reference continuation, or (wrong) each of them plus one."""

    def __init__(self, conts, k, wrong):
        self.conts, self.k, self.wrong = conts, k, wrong

    def propose(self, rows, sampled):
        out = []
        for r, toks in zip(rows, sampled):
            st = r.request
            n = st.num_output_tokens
            d = list(self.conts[tuple(st.prompt_token_ids)][n:n + self.k]) if toks else []
            out.append([(t + 1) % 512 for t in d] if self.wrong else d)
        return out


@pytest.fixture(scope="module")
def v32(tmp_path_factory):
    """(the engine, its greedy outputs without drafts) on the tiny sparse V3.2 checkpoint."""
    path = make_deepseek_v32_checkpoint(tmp_path_factory.mktemp("v32_sparse_spec"))
    llm = LLM(str(path), **KW)
    assert llm.engine.runner.model.model.layers[0].self_attn.indexer.index_topk == 4
    return llm, _generate(llm)


def _generate(llm, proposer=None):
    runner = llm.engine.runner
    runner.proposer = proposer
    try:
        sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    finally:
        runner.proposer = None
    return [o.outputs[0].token_ids for o in outs]


def _check(llm, ref, k, wrong):
    stats = llm.engine.spec_stats
    drafted0, accepted0 = stats.num_draft_tokens, stats.num_accepted_tokens
    got = _generate(llm, _Scripted(dict(zip(map(tuple, PROMPTS), ref)), k, wrong))
    assert got == ref
    assert stats.num_draft_tokens > drafted0
    assert (stats.num_accepted_tokens > accepted0) == (not wrong)


@pytest.mark.parametrize("wrong", [False, True], ids=["right-drafts", "wrong-drafts"])
@pytest.mark.parametrize("k", [1, 2])
def test_sparse_v32_speculation_is_lossless(v32, k, wrong):
    llm, ref = v32
    _check(llm, ref, k, wrong)


def test_sparse_v32_speculation_on_the_triton_path(v32, monkeypatch):
    from gyrfalcon.kernels.common import HAS_TRITON

    if not HAS_TRITON:
        pytest.skip("triton (or its interpreter) is not available")
    import gyrfalcon.layers.dsa_indexer as dsa_layer
    import gyrfalcon.layers.mla as mla_layer
    from gyrfalcon.kernels.dsa_indexer import indexer_topk_triton
    from gyrfalcon.kernels.mla_attention import mla_decode_triton, mla_prefill_triton
    from test_deepseek_v3 import _triton_prep

    calls = {"decode": 0, "prefill": 0, "indexer": 0, "kv_prep": 0, "q_prep": 0, "v_proj": 0}
    dense = mla_layer.mla_attention
    llm, ref = v32
    # The sparse prefill launches of the drafts-free run (on the reference path: the Triton path's one-token steps
    # against transformers are test_deepseek_v32's test_gpu_kernels_in_the_model).
    prefill_calls = 0

    def counted(q, cache, bt, sl, qsl, scale, L, is_decode=False, num_splits=None, indices=None):
        nonlocal prefill_calls
        prefill_calls += indices is not None and not is_decode
        return dense(q, cache, bt, sl, qsl, scale, L, is_decode, num_splits, indices)

    monkeypatch.setattr(mla_layer, "mla_attention", counted)
    assert _generate(llm) == ref

    def triton_attention(q, cache, bt, sl, qsl, scale, L, is_decode=False, num_splits=None, indices=None):
        if indices is None:
            return dense(q, cache, bt, sl, qsl, scale, L, is_decode, num_splits)
        calls["decode" if is_decode else "prefill"] += 1
        if is_decode:
            return mla_decode_triton(q, cache, bt, sl, scale, L, num_splits, indices=indices)
        return mla_prefill_triton(q, cache, bt, sl, qsl, scale, L, indices=indices)

    def triton_topk(*args):
        calls["indexer"] += 1
        return indexer_topk_triton(*args)

    monkeypatch.setattr(mla_layer, "mla_attention", triton_attention)
    monkeypatch.setattr(dsa_layer, "indexer_topk", triton_topk)
    _triton_prep(monkeypatch, mla_layer, calls)
    _check(llm, ref, 2, wrong=True)
    assert all(calls.values()), calls
    # The same prefill chunks as without drafts, and the verify steps through the per-token sparse rows beyond them.
    assert calls["prefill"] > prefill_calls, calls
