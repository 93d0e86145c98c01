"""Request: one sequence the engine generates for, as the CPU-side bookkeeping sees it."""

from __future__ import annotations

import enum
import time
from typing import List, Optional

from gyrfalcon.sampling_params import SamplingParams
from gyrfalcon.step_io import TokenSequence


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


class Request(TokenSequence):
    """A prompt, its sampling params, its output tokens and its KV blocks.

    `num_computed_tokens` counts the tokens whose K/V sit in the cache; the tokens from there to
    `num_tokens` still have to run through the model (the rest of the prompt, or after a
    preemption the prompt and the outputs so far: recompute).
    """

    def __init__(self, request_id: str, prompt_token_ids: List[int], sampling_params: SamplingParams,
                 eos_token_ids: Optional[List[int]] = None, max_model_len: Optional[int] = None,
                 arrival_time: Optional[float] = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = list(eos_token_ids or [])
        self.output_token_ids: List[int] = []
        # Per output token: (logprob of the sampled token, [(token, logprob)] top-N) when asked.
        self.output_logprobs: List[tuple] = []
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Tokens sampled by a step that was scheduled but whose result has not been applied yet.
        self.num_inflight = 0
        self.num_cached_tokens = 0  # prefix-cache hits at first scheduling
        # Prompt tokens whose logprob has been reported (prompt_logprobs; token 0 has none), so that a
        # recompute after preemption does not report them twice.
        self.num_prompt_logprobs_sent = 1
        self.block_ids: List[int] = []
        self.block_hashes: List[bytes] = []  # chained hashes of the full blocks, filled lazily
        self.num_registered_blocks = 0  # leading blocks already offered to the prefix cache
        # What the runner has of this request: whether it knows the request at all (not after a preemption),
        # and how many of block_ids it was sent.
        self.known_to_runner = False
        self.num_blocks_sent = 0
        # Its slot in the linear-attention state pools (engine/state_manager.py), while it holds one.
        self.state_slot: Optional[int] = None
        # Draft tokens proposed for the next step (speculative decoding), verified there.
        self.spec_token_ids: List[int] = []
        self.stop_reason: Optional[int | str] = None
        self.num_preemptions = 0
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.first_scheduled_time: Optional[float] = None
        max_tokens = sampling_params.max_tokens
        if max_model_len is not None:
            room = max_model_len - len(self.prompt_token_ids)
            max_tokens = room if max_tokens is None else min(max_tokens, room)
        self.max_tokens = max_tokens if max_tokens is not None else 1 << 30

    @property
    def all_token_ids(self) -> List[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> Optional[str]:
        if self.status == RequestStatus.FINISHED_STOPPED:
            return "stop"
        if self.status == RequestStatus.FINISHED_LENGTH:
            return "length"
        if self.status == RequestStatus.FINISHED_ABORTED:
            return "abort"
        return None

    def append_output(self, token_id: int, logprob_entry: Optional[tuple] = None) -> None:
        self.output_token_ids.append(token_id)
        if logprob_entry is not None:
            self.output_logprobs.append(logprob_entry)

    def check_stop(self) -> bool:
        """Set a finished status from the last token; return True when the request is done.

        Stop strings are the front end's job (they need text); stop ids, eos and lengths are here.
        """
        n_out = len(self.output_token_ids)
        if n_out == 0:
            return False
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if n_out >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in params.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if n_out >= self.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens}, "
                f"{self.status.value})")
