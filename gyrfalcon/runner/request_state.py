"""The runner's own per-request state, kept across steps from the scheduler's plain-data batches.

The scheduler sends a request's prompt, sampling params and blocks once (NewRequestData on its first step,
again after a preemption) and afterwards only what changed (new block ids, draft tokens); the runner appends
the tokens it samples itself. So the runner never reads the engine's Request objects and can live in another
process (one worker per GPU rank): the model runner v2 idea of persistent state apart from per-step inputs.
"""

from __future__ import annotations

from typing import Dict, List

from gyrfalcon.step_io import TokenSequence


class RequestState(TokenSequence):
    """What the runner knows of one request: its tokens (prompt + the outputs it sampled), sampling params,
    block table and state slots. Its token accessors (TokenSequence, as engine.Request's) are what the input
    preparation reads (forward_batch.pack_host_batch, the graphs' static inputs)."""

    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "sampling_params", "eos_token_ids",
                 "block_ids", "state_slots", "num_inflight", "proposer_state")

    def __init__(self, request_id: str, new) -> None:
        self.request_id = request_id
        self.prompt_token_ids: List[int] = list(new.prompt_token_ids)
        self.output_token_ids: List[int] = list(new.output_token_ids)
        self.sampling_params = new.sampling_params
        self.eos_token_ids: List[int] = list(new.eos_token_ids)
        self.block_ids: List[int] = []
        self.state_slots: Dict[str, int] = dict(new.state_slots)
        # Steps launched that sample this request whose tokens the runner has not read back yet.
        self.num_inflight = 0
        # A proposer's per-request state (spec_decode/ngram.py: its token buffer), dropped with the request.
        self.proposer_state = None


class RequestStates:
    """request id -> RequestState, updated from each ScheduledBatch before its step runs."""

    def __init__(self) -> None:
        self.states: Dict[str, RequestState] = {}

    def __len__(self) -> int:
        return len(self.states)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.states

    def __getitem__(self, request_id: str) -> RequestState:
        return self.states[request_id]

    def apply(self, batch) -> list:
        """batch: the engine's ScheduledBatch (plain data; runner/ does not import engine/).
        Drop the finished requests, add the new ones (a resumed one replaces its old state), extend block
        tables, and attach each scheduled request's state to it (`sr.request`: what input preparation reads,
        with the same token accessors as engine.Request); returns batch.reqs. The batch's own objects carry
        the state: a large decode batch makes no new object per request per step."""
        for rid in batch.finished_request_ids:
            self.states.pop(rid, None)
        for sr in batch.reqs:
            if sr.new_request is not None:
                st = RequestState(sr.request_id, sr.new_request)
                self.states[sr.request_id] = st
            else:
                st = self.states[sr.request_id]
            if sr.new_block_ids:
                st.block_ids.extend(sr.new_block_ids)
            sr.request = st
        return batch.reqs
