"""SpecDecodingStats: speculative decoding's counters, vLLM's (spec_decode_num_drafts, num_draft_tokens,
num_accepted_tokens, num_accepted_tokens per draft position), counted by the engine from each verify step's
results. Mean acceptance length = 1 + accepted / drafts: the tokens one verify step yields on average."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List


@dataclass
class SpecDecodingStats:
    num_drafts: int = 0  # verify steps of a request (one per request per step that carried drafts)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [k]: how often the draft at position j was accepted (position j needs 0..j-1 accepted too).
    accepted_per_pos: List[int] = field(default_factory=list)

    def observe(self, num_draft: int, num_accepted: int) -> None:
        """One request's verify step: num_draft drafts, the first num_accepted of them kept."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft:
            self.accepted_per_pos.extend([0] * (num_draft - len(self.accepted_per_pos)))
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted drafts per verify step (1.0 with no drafts)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "accepted_per_pos": list(self.accepted_per_pos)}


def spec_decode_summary(before: dict, after: dict):
    """Speculative decoding between two snapshots of the counters (as_dict's keys; the benchmarks take them before
    and after their timed runs): mean acceptance length (1 + accepted / drafts, vLLM's), the acceptance rate
    (accepted / draft tokens) and the acceptance rate at each draft position; None without drafts."""
    drafts = after["num_drafts"] - before["num_drafts"]
    if not drafts:
        return None
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    draft_tokens = after["num_draft_tokens"] - before["num_draft_tokens"]
    pos0 = list(before["accepted_per_pos"])
    pos0 += [0] * (len(after["accepted_per_pos"]) - len(pos0))
    return {"num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
            "mean_acceptance_length": 1 + accepted / drafts, "acceptance_rate": accepted / draft_tokens,
            "acceptance_per_pos": [(a - b) / drafts for a, b in zip(after["accepted_per_pos"], pos0)]}
