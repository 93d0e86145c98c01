"""What crosses between the engine and a runner each step, as plain data: ScheduledBatch (engine -> runner)
and RunnerOutput (runner -> engine), with a msgpack codec so a runner can live in another process.

Both sides import this module (it sits at the bottom with config and sampling_params); the runner never sees
the engine's Request objects, only what is here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from gyrfalcon.sampling_params import SamplingParams


class TokenSequence:
    """The token accessors of a request's prompt + outputs, shared by the engine's Request and the runner's
    RequestState (each keeps its own prompt_token_ids and output_token_ids lists)."""

    __slots__ = ()
    prompt_token_ids: List[int]
    output_token_ids: List[int]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_id_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def token_ids(self, lo: int, hi: int) -> List[int]:
        """Tokens lo..hi-1 of prompt + outputs, without building the whole concatenation (that copies a long
        prompt for every call: per block hashed, per row of every eager step)."""
        n = len(self.prompt_token_ids)
        if hi <= n:
            return self.prompt_token_ids[lo:hi]
        if lo >= n:
            return self.output_token_ids[lo - n:hi - n]
        return self.prompt_token_ids[lo:] + self.output_token_ids[:hi - n]


@dataclass
class NewRequestData:
    """What the runner needs to know about a request the first time it runs it (and again after a
    preemption, when it restarts from scratch): plain data that can cross a process boundary."""

    prompt_token_ids: List[int]
    sampling_params: SamplingParams
    eos_token_ids: List[int]
    # Outputs so far (a preempted request resumes with them: they are recomputed with the prompt).
    output_token_ids: List[int] = field(default_factory=list)
    # Its slot in each state group (linear-attention layers): {group name: slot}; empty without such layers.
    state_slots: Dict[str, int] = field(default_factory=dict)


@dataclass
class ScheduledRequest:
    """One request's share of a step, as plain data (the runner keeps its own per-request state and never
    reads the engine's Request).

    Tokens start..start + num_new_tokens - 1 run this step. The last len(spec_token_ids) of them are draft
    tokens to verify (a speculative step: 1 + k tokens, every one sampled); the runner has the others.
    Sequences are lists, or the empty tuple where there is nothing (a decode step's usual case: a large batch
    builds no empty list per request per step for the garbage collector to count).
    """

    request_id: str
    start: int
    num_new_tokens: int
    # Whether this step ends on the request's last token, so it yields sampled token(s) (False for a
    # prefill chunk that leaves part of the prompt for later).
    sample: bool
    # Blocks appended to the request's block table since the runner last saw it (all of them on a new one).
    new_block_ids: Sequence[int] = ()
    spec_token_ids: Sequence[int] = ()
    new_request: Optional[NewRequestData] = None
    # The runner's RequestState of this request, attached on the runner's side when the step is applied
    # (runner/request_state.py); never encoded.
    request: Any = field(default=None, repr=False, compare=False)

    @property
    def num_sampled_rows(self) -> int:
        """Rows whose next token is sampled: the last one, and each draft's (1 + k on a verify step)."""
        return (1 + len(self.spec_token_ids)) if self.sample else 0


@dataclass
class ScheduledBatch:
    """What the scheduler decided for one step; the runner turns it into a ForwardBatch."""

    reqs: List[ScheduledRequest] = field(default_factory=list)
    # Requests that ended since the last step: the runner drops its per-request state.
    finished_request_ids: Set[str] = field(default_factory=set)
    num_preempted: int = 0
    # Linear-attention state snapshots (hybrid models' prefix caching, engine/snapshot_pool.py): (snapshot id,
    # state slot) pairs copied into the slots before the step's forward; (row, position, snapshot id) triples
    # written during it: the state of reqs[row] after its first `position` tokens (a block boundary inside the
    # row's tokens this step, start < position <= start + num_new_tokens), by the layers themselves.
    state_restores: List[Tuple[int, int]] = field(default_factory=list)
    state_saves: List[Tuple[int, int, int]] = field(default_factory=list)
    # The engine's own Request of each entry of reqs (engine-side bookkeeping; never encoded for a runner).
    requests: List[Any] = field(default_factory=list, repr=False, compare=False)

    @property
    def total_num_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.reqs)

    @property
    def is_empty(self) -> bool:
        return not self.reqs

    @property
    def has_spec_tokens(self) -> bool:
        return any(r.spec_token_ids for r in self.reqs)


@dataclass
class RunnerOutput:
    """Aligned with ScheduledBatch.reqs. sampled[i]: the tokens request i produced this step (empty for a
    prefill chunk that stops mid-prompt; one token; on a verify step of k drafts, the accepted drafts and
    one more). logprobs[i]: per token, (logprob, rank, [(token_id, logprob), ...top-N]) when asked, else
    empty. prompt_logprobs[i]: entries for prompt tokens start + 1, start + 2, ... when asked.
    spec_token_ids[i]: draft tokens proposed for request i's next step (speculative decoding), or None."""

    sampled: List[List[int]]
    logprobs: List[List[tuple]]
    prompt_logprobs: Optional[List[Optional[list]]] = None
    spec_token_ids: Optional[List[List[int]]] = None


def _sampling_params_dict(p: SamplingParams) -> Dict[str, Any]:
    return p.to_dict()  # (structured_outputs as a plain map)


def encode_batch(batch: ScheduledBatch) -> bytes:
    """The batch as msgpack (never pickle across a socket); the engine-side `requests` stay behind."""
    import msgpack  # (the serve extra's; the offline engine never encodes)

    reqs = []
    for r in batch.reqs:
        new = None
        if r.new_request is not None:
            n = r.new_request
            new = [n.prompt_token_ids, _sampling_params_dict(n.sampling_params), n.eos_token_ids,
                   n.output_token_ids, n.state_slots]
        reqs.append([r.request_id, r.start, r.num_new_tokens, r.sample, list(r.new_block_ids), list(r.spec_token_ids),
                     new])
    return msgpack.packb([reqs, sorted(batch.finished_request_ids), batch.num_preempted, batch.state_restores,
                          batch.state_saves], use_bin_type=True)


def decode_batch(data: bytes) -> ScheduledBatch:
    import msgpack

    reqs, finished, num_preempted, restores, saves = msgpack.unpackb(data, raw=False, strict_map_key=False)
    out = []
    for rid, start, n, sample, blocks, spec, new in reqs:
        nr = None
        if new is not None:
            prompt, params, eos, outputs, slots = new
            nr = NewRequestData(prompt, SamplingParams(**params), eos, outputs, slots)
        out.append(ScheduledRequest(rid, start, n, sample, blocks or (), spec or (), nr))
    return ScheduledBatch(out, set(finished), num_preempted, state_restores=[tuple(p) for p in restores],
                          state_saves=[tuple(p) for p in saves])


def encode_output(out: RunnerOutput) -> bytes:
    import msgpack

    return msgpack.packb([out.sampled, out.logprobs, out.prompt_logprobs, out.spec_token_ids], use_bin_type=True)


def decode_output(data: bytes) -> RunnerOutput:
    import msgpack

    sampled, logprobs, plp, spec = msgpack.unpackb(data, raw=False, strict_map_key=False)

    def tup(lp):  # msgpack returns lists; logprob entries are tuples with a list of (id, logprob) pairs
        return (lp[0], lp[1], [tuple(t) for t in lp[2]])
    logprobs = [[tup(lp) for lp in row] for row in logprobs]
    if plp is not None:
        plp = [None if row is None else [tup(e) for e in row] for row in plp]
    return RunnerOutput(sampled, logprobs, plp, spec)
