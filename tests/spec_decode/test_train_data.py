"""train-draft's data: one response per prompt and temperature (train/data.py generate_sequences), so sampled
responses can add contexts beside the greedy one that verification keeps."""

from __future__ import annotations

import pytest

from checkpoints import make_checkpoint
from gyrfalcon.llm import LLM
from gyrfalcon.sampling_params import SamplingParams
from gyrfalcon.train.data import generate_sequences

PROMPTS = ["the cat sat", "a dog ran fast", "blue sky"]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(str(make_checkpoint(tmp_path_factory.mktemp("tgt"), "llama")), device="cpu", max_model_len=128)


def test_one_response_per_prompt_and_temperature(llm):
    seqs = generate_sequences(llm, PROMPTS, 12, [0.0, 1.0, 1.0], raw=True, seed=7)
    assert len(seqs) == 3 * len(PROMPTS)
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    for (ids, plen), out in zip(seqs[:3], greedy):  # grouped by temperature: the greedy group first
        assert ids[:plen] == list(out.prompt_token_ids) and ids[plen:] == list(out.outputs[0].token_ids)
    # the two samples of each prompt draw from their own seeds (seed + j): they differ, and each is reproducible
    assert [s[0] for s in seqs[3:6]] != [s[0] for s in seqs[6:9]]
    again = generate_sequences(llm, PROMPTS, 12, [0.0, 1.0, 1.0], raw=True, seed=7)
    assert again == seqs
    assert generate_sequences(llm, PROMPTS, 12, 0.0, raw=True, seed=7) == seqs[:3]


def test_bad_temperatures_are_refused(llm):
    with pytest.raises(ValueError, match="same sequence twice"):
        generate_sequences(llm, PROMPTS, 4, [0.0, 0.0], raw=True)
    with pytest.raises(ValueError, match=">= 0"):
        generate_sequences(llm, PROMPTS, 4, [-1.0], raw=True)
