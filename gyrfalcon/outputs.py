"""What generate() returns, with vLLM's names: RequestOutput holding one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Union


@dataclass
class Logprob:
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# One dict per generated token: token id -> Logprob (the sampled token and the top-N).
SampleLogprobs = List[Dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: List[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[SampleLogprobs]
    finish_reason: Optional[str] = None  # "stop", "length", "abort" or None while running
    stop_reason: Union[int, str, None] = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    outputs: List[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: Dict[str, float] = field(default_factory=dict)
    # With prompt_logprobs: None for the first prompt token, then per token a dict as in `logprobs`.
    prompt_logprobs: Optional[List[Optional[Dict[int, Logprob]]]] = None
