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


class OracleDrafts:
    """A proposer whose drafts are the reference continuation (greedy outputs without speculation) with one token
    spoiled at a position that cycles with the output length, so verify steps keep 0..k drafts (every rollback
    depth) and sometimes all of them; a random head's own drafts would all be rejected. spoil(token) -> another
    token id inside the vocabulary."""

    def __init__(self, prompts, refs, k: int, spoil) -> None:
        self.refs, self.k, self.spoil = {tuple(p): r for p, r in zip(prompts, refs)}, k, spoil

    def propose(self, rows, sampled) -> List[List[int]]:
        out = []
        for r, toks in zip(rows, sampled):
            if not toks:
                out.append([])
                continue
            n = len(r.request.output_token_ids)
            d = list(self.refs[tuple(r.request.prompt_token_ids)][n:n + self.k])
            bad = (n * 7 // 3) % (self.k + 1)
            if bad < len(d):
                d[bad] = self.spoil(d[bad])
            out.append(d)
        return out
