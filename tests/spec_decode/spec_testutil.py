"""Helpers the speculative-decoding tests share."""

from __future__ import annotations

from typing import List, Tuple


def record_drafts(llm) -> List[Tuple[List[int], List[int]]]:
    """Wrap the engine's proposer so that every draft it makes is recorded with the sequence it was made from:
    the returned list fills with (prompt + output token ids at that moment, the drafts) as the engine runs."""
    prop = llm.engine.runner.proposer
    seen: List[Tuple[List[int], List[int]]] = []
    propose = prop.propose

    def spy(rows, sampled):
        out = propose(rows, sampled)
        for r, toks, d in zip(rows, sampled, out):
            if toks:
                seen.append((list(r.request.prompt_token_ids) + list(r.request.output_token_ids), d))
        return out
    prop.propose = spy
    return seen
