"""Speculative decoding's proposers: they draft the next k tokens of each sequence after a step, and the next
step verifies them (ModelRunner.complete keeps drafts up to the first that differs from the token sampled at
that position). A proposer has one method, propose(rows, sampled) -> drafts per row (docs/spec_decode.md)."""

from __future__ import annotations


def build_proposer(config, model, device, next_layer_idx: int):
    """The proposer config.speculative_config names, or None (no speculation, or a proposer set by hand).
    next_layer_idx: the first cache-plan index after the target's layers (a draft model's own paged layer)."""
    sc = config.speculative_config
    if sc.method == "ngram":
        from gyrfalcon.spec_decode.ngram import NgramProposer
        return NgramProposer(sc.num_speculative_tokens, sc.prompt_lookup_min, sc.prompt_lookup_max)
    if sc.method == "eagle3":
        from gyrfalcon.spec_decode.eagle3 import Eagle3Proposer
        return Eagle3Proposer(config, model, device, next_layer_idx)
    if sc.method == "mtp":
        from gyrfalcon.spec_decode.mtp import MtpProposer
        return MtpProposer(config, model, device, next_layer_idx)
    return None
