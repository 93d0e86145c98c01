"""speculative_config: vLLM's keys, method detection from a draft's config, clear errors for bad ones."""

from __future__ import annotations

import json

import pytest

from gyrfalcon.config import SpeculativeConfig


def _resolved(value, target="target"):
    sc = SpeculativeConfig.from_any(value)
    sc.resolve(target)
    return sc


def test_ngram_defaults_and_json_string():
    sc = _resolved('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (sc.method, sc.num_speculative_tokens, sc.prompt_lookup_min, sc.prompt_lookup_max) == ("ngram", 3, 5, 5)
    sc = _resolved({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4})
    assert (sc.prompt_lookup_min, sc.prompt_lookup_max) == (4, 4)
    sc = _resolved({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    assert (sc.prompt_lookup_min, sc.prompt_lookup_max) == (1, 3)
    assert not _resolved(None).enabled


@pytest.mark.parametrize("value,match", [
    ("{not json", "not valid JSON"),
    ([1, 2], "must be a dict"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown key"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "0..16"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min <= prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "takes no model"),
    ({"method": "eagle3", "num_speculative_tokens": 2}, "needs a draft 'model'"),
    ({"method": "eagle3", "num_speculative_tokens": 2, "prompt_lookup_max": 2}, "ngram method's"),
    ({"num_speculative_tokens": 2, "prompt_lookup_max": 2}, "no method given"),
    ({"num_speculative_tokens": 2}, "no method given"),
])
def test_bad_configs_are_refused_clearly(value, match):
    with pytest.raises(ValueError, match=match):
        _resolved(value)


def test_mtp_defaults_to_the_target(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"]}))
    sc = _resolved({"method": "mtp", "num_speculative_tokens": 1}, target=str(tmp_path))
    assert (sc.method, sc.model, sc.num_speculative_tokens) == ("mtp", str(tmp_path), 1)


def test_method_and_k_read_from_a_speculators_config(tmp_path):
    cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
           "speculators_config": {"algorithm": "eagle3", "proposal_methods": [
               {"proposal_type": "greedy", "speculative_tokens": 3}]}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    sc = _resolved({"model": str(tmp_path), "num_speculative_tokens": None})
    assert (sc.method, sc.num_speculative_tokens) == ("eagle3", 3)
    sc = _resolved({"model": str(tmp_path), "num_speculative_tokens": 2})
    assert (sc.method, sc.num_speculative_tokens) == ("eagle3", 2)
    with pytest.raises(ValueError, match="is an eagle3 draft"):
        _resolved({"method": "mtp", "model": str(tmp_path), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="has no config.json"):
        _resolved({"method": "eagle3", "model": str(tmp_path / "nowhere"), "num_speculative_tokens": 2})


def test_cli_flag_reaches_the_engine_kwargs():
    import argparse

    from gyrfalcon.cli import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    sc = _resolved(engine_kwargs(args)["speculative_config"])
    assert (sc.method, sc.num_speculative_tokens) == ("ngram", 2)


def test_scheduler_allocates_lookahead_slots_for_sampling_steps():
    """A draft model's chained passes write k - 1 positions past a sampling step: the scheduler gives those slots
    to every sampling step (no further than prompt + max_tokens) and none to a prefill chunk that stops short."""
    from gyrfalcon.engine.block_manager import BlockManager
    from gyrfalcon.engine.request import Request
    from gyrfalcon.engine.scheduler import Scheduler
    from gyrfalcon.sampling_params import SamplingParams

    bm = BlockManager(64, 4, True)
    s = Scheduler(bm, 8, 6, num_lookahead_tokens=2)
    r = Request("a", list(range(10)), SamplingParams(max_tokens=2, ignore_eos=True))
    s.add_request(r)
    batch = s.schedule()  # a chunk of 6 of the 10 prompt tokens: no lookahead, 2 blocks
    assert not batch.reqs[0].sample and len(r.block_ids) == 2
    s.update(batch, [[]])
    batch = s.schedule()  # the last 4 prompt tokens, sampled: 10 tokens + 2 lookahead = 12 slots, 3 blocks
    assert batch.reqs[0].sample and len(r.block_ids) == 3
    s.update(batch, [[50]])
    batch = s.schedule()  # the decode at position 10: prompt + max_tokens = 12 caps the lookahead at 1 (not 13)
    assert batch.reqs[0].num_new_tokens == 1 and len(r.block_ids) == 3
