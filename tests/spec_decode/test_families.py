"""Speculation on the families past the dense ones (their verify steps through MoE and MLA layers; EAGLE-3 over
their residual streams): greedy outputs equal the same engine's without drafts, which tests/models holds against
transformers. Hybrid (linear-attention) targets: test_mtp_hybrid.py."""

from __future__ import annotations

import pytest

from checkpoints import make_deepseek_checkpoint, make_moe_checkpoint
from eagle3_checkpoints import make_eagle3_draft
from gyrfalcon import LLM, SamplingParams

PROMPTS = [[5, 9, 13, 2, 7, 5, 9, 13, 2], [11, 4, 4, 8, 30, 6, 1, 3, 17], [21, 3, 21, 3, 21]]


def _greedy(llm):
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp,
                                                         use_tqdm=False)]


# (MiniMax-M2 stands for the MoE families: sigmoid-routed experts, and the EAGLE-3 target its releases use.)
@pytest.mark.parametrize("family", ["minimax_m2", "deepseek_v3"])
def test_moe_and_mla_families(tmp_path, family):
    if family == "deepseek_v3":
        target = make_deepseek_checkpoint(tmp_path / "t")
    else:
        target = make_moe_checkpoint(tmp_path / "t", family)
    kw = dict(device="cpu", block_size=4, max_model_len=128, max_num_batched_tokens=8)
    ref = _greedy(LLM(str(target), **kw))
    ngram = LLM(str(target), **kw, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                        "prompt_lookup_min": 1, "prompt_lookup_max": 2})
    assert _greedy(ngram) == ref
    assert ngram.engine.spec_stats.num_drafts > 0
    draft = make_eagle3_draft(tmp_path / "d", target, "speculators", aux_ids=[0, 1, 2])
    eagle = LLM(str(target), **kw, speculative_config={"model": str(draft), "num_speculative_tokens": 2})
    assert _greedy(eagle) == ref
    assert eagle.engine.spec_stats.num_drafts > 0

