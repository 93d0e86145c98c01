"""Engine: the scheduler and the model runner, stepped together.

Token ids in, token ids out: text is the front end's business (LLM, or the HTTP server).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from typing import List, Optional

from gyrfalcon import envs
from gyrfalcon.engine.block_manager import BlockManager
from gyrfalcon.engine.request import Request, RequestStatus
from gyrfalcon.engine.scheduler import RequestUpdate, Scheduler
from gyrfalcon.engine.snapshot_pool import SnapshotPool
from gyrfalcon.engine.spec_stats import SpecDecodingStats
from gyrfalcon.engine.state_manager import StateManager
from gyrfalcon.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def freeze_gc_after_startup(default: bool) -> bool:
    """Move everything alive now (modules, weights' wrappers, captured graphs, imported libraries: ~215k
    tracked objects for the demo model on a CPU) out of the cyclic garbage collector's sight, so that a full
    collection while serving walks only what requests create. It shortens the pauses (a full collection
    walks a fraction of the objects), not their sum, and a pause lands between two decode steps of every
    running request: TPOT's tail (measured on the H200; docs/performance.md). Frozen objects that later become
    cyclic garbage are never freed, so it suits a process that serves one engine for its lifetime: the
    server's engine core does it by default (default=True), the offline LLM only when asked (a process may
    build and drop several, each holding GPU memory). GYRFALCON_GC_FREEZE=1 / 0 forces either way.
    Returns whether it froze."""
    forced = envs.get().gc_freeze
    if not (forced if forced is not None else default):
        return False
    gc.collect()
    gc.freeze()
    return True


@contextlib.contextmanager
def gc_frozen_while_running():
    """For the length of one offline run (LLM.generate's loop): what is alive when it starts (the engine, the model,
    the caller's objects) leaves the cyclic collector's sight and comes back when it ends. Without it, a full
    collection that the steps' allocations trigger walks all of it, a pause of a whole step or more between two
    steps of every running request (benchmarks/host_step.py counts them). Unlike freeze_gc_after_startup nothing
    stays frozen after the run, so an LLM that is dropped later is still freed. Only when nothing is frozen already
    (a startup freeze, or the caller's own, is left alone), and not with GYRFALCON_GC_FREEZE=0."""
    if envs.get().gc_freeze is False or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class Engine:
    def __init__(self, config, eos_token_ids: List[int], runner=None) -> None:
        """`runner` defaults to the executor of config (engine/executor.py: the ModelRunner itself on one device,
        worker processes under tensor parallelism; imported there, so engine/ itself stays free of CUDA code and
        its tests can pass a fake runner)."""
        self.config = config
        if runner is None:
            from gyrfalcon.engine.executor import create_executor
            runner = create_executor(config)
        self.runner = runner
        self.eos_token_ids = list(eos_token_ids)
        cc, sc = config.cache_config, config.scheduler_config
        self.max_model_len = config.model_config.max_model_len
        self.vocab_size = self.read_vocab_size(config)
        self.block_manager = BlockManager(runner.num_blocks, cc.block_size, cc.enable_prefix_caching)
        max_len_blocks = self.block_manager.blocks_needed(self.max_model_len)
        if max_len_blocks > runner.num_blocks:
            raise ValueError(
                f"The KV cache holds {runner.num_blocks} blocks of {cc.block_size} tokens "
                f"({runner.num_blocks * cc.block_size} tokens), fewer than one sequence of "
                f"max_model_len={self.max_model_len} needs; lower max_model_len or give the cache more memory.")
        # Linear-attention layers: one state slot per running request, out of the pool the runner allocated.
        num_slots = getattr(runner, "num_state_slots", 0)
        # Their prefix caching: snapshots of that state at block boundaries, out of the runner's snapshot pool.
        num_snapshots = getattr(runner, "num_state_snapshots", 0)
        snapshots = (SnapshotPool(num_snapshots, runner.state_snapshot_stride)
                     if num_slots and num_snapshots and cc.enable_prefix_caching else None)
        self.scheduler = Scheduler(self.block_manager, sc.max_num_seqs, sc.max_num_batched_tokens,
                                   sc.enable_chunked_prefill, StateManager(num_slots) if num_slots else None,
                                   snapshots, num_lookahead_tokens=getattr(runner, "num_lookahead_tokens", 0))
        self.async_scheduling = bool(getattr(sc, "async_scheduling", False))
        self._inflight = None  # the launched step whose tokens have not been read back
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        self.last_step_num_tokens = 0  # tokens the last step() scheduled (the iteration_tokens_total histogram)
        self.spec_stats = SpecDecodingStats()

    @staticmethod
    def read_vocab_size(config) -> Optional[int]:
        """The model's vocabulary size (None if its config has none), read once into `vocab_size` by whoever runs
        validate_prompt / validate_params: a transformers config's attribute access is slow (~4 us under
        cProfile), and every request is checked."""
        return getattr(config.model_config.hf_config, "vocab_size", None)

    def validate_prompt(self, prompt_token_ids: List[int]) -> None:
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("The prompt is empty: at least one token is needed.")
        if n >= self.max_model_len:
            raise ValueError(
                f"The prompt is {n} tokens long, which does not fit max_model_len={self.max_model_len} "
                f"(the prompt must be shorter than {self.max_model_len} tokens to leave room for output).")
        vocab = self.vocab_size
        # min / max run in C: a per-token Python check took ~16 us a 128-token prompt under cProfile, and a prompt is
        # checked twice on its way in (LLM.generate before submitting any, then here); a batch's TTFT pays for all.
        if vocab is not None and (min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab):
            bad = next(t for t in prompt_token_ids if not 0 <= t < vocab)
            raise ValueError(f"Token id {bad} is out of range for a vocabulary of {vocab}.")

    def validate_params(self, sampling_params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: token ids against the model's vocabulary, and that a
        structured-outputs schema / regex / grammar parses (a ValueError naming the problem)."""
        if sampling_params.structured_outputs is not None:
            sampling_params.structured_outputs.build_grammar()
        vocab = self.vocab_size
        if vocab is None:
            return
        bad = [t for t in (sampling_params.logit_bias or {}) if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"logit_bias: token id {bad[0]} is out of range for a vocabulary of {vocab}.")

    def add_request(self, request_id: str, prompt_token_ids: List[int],
                    sampling_params: SamplingParams, arrival_time: Optional[float] = None) -> Request:
        self.validate_prompt(prompt_token_ids)
        self.validate_params(sampling_params)
        req = Request(request_id, prompt_token_ids, sampling_params, self.eos_token_ids,
                      self.max_model_len, arrival_time)
        self.scheduler.add_request(req)
        self.num_prompt_tokens_total += len(prompt_token_ids)
        return req

    def abort_request(self, request_id: str) -> bool:
        return self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED) is not None

    def finish_request(self, request_id: str) -> bool:
        """End a request that the front end saw stop (a stop string)."""
        return self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED) is not None

    def check_health(self) -> None:
        """Raise if the runner cannot step any more (a tensor-parallel worker died: engine/executor_mp.py)."""
        check = getattr(self.runner, "check_health", None)
        if check is not None:
            check()

    def shutdown(self) -> None:
        """Stop the runner's worker processes, if it has any (an in-process runner has nothing to stop)."""
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._inflight is not None

    def step(self) -> List[RequestUpdate]:
        """Schedule and run one step; return the token updates that became known.

        With async_scheduling the next step is scheduled and launched before the previous one's
        tokens are read back, so the host's bookkeeping overlaps the device's work; the updates
        returned are then those of the previous step. A request that finished (eos) in the step
        before may run one surplus step, whose token is dropped. Requests whose sampling depends on
        their exact output history (penalties, min_tokens, a grammar's mask) make the engine wait first.
        """
        updates: List[RequestUpdate] = []
        if self._inflight is not None and self._needs_exact_state():
            updates += self._complete(self._inflight)
            self._inflight = None
        batch = self.scheduler.schedule()
        self.last_step_num_tokens = 0 if batch.is_empty else batch.total_num_tokens
        handle = self.runner.launch(batch)
        if self._inflight is not None:
            updates += self._complete(self._inflight)
            self._inflight = None
        if self.async_scheduling and not batch.is_empty:
            self._inflight = handle
        else:
            updates += self._complete(handle)
        return updates

    def _complete(self, handle) -> List[RequestUpdate]:
        out = self.runner.complete(handle)
        if handle.batch.has_spec_tokens:
            for sr, toks in zip(handle.batch.reqs, out.sampled):
                if sr.spec_token_ids and toks:
                    self.spec_stats.observe(len(sr.spec_token_ids), len(toks) - 1)
        updates = self.scheduler.update(handle.batch, out.sampled, out.logprobs, out.prompt_logprobs,
                                        out.spec_token_ids)
        self.num_generation_tokens_total += sum(len(u.new_token_ids) for u in updates)
        return updates

    def _needs_exact_state(self) -> bool:
        if self._inflight.batch.has_spec_tokens or getattr(self.runner, "proposes_drafts", False):
            # The next step's drafts and rollbacks come from this step's results.
            return True
        if self.scheduler.num_history_dependent == 0:
            return False  # the common case, without a scan of every running request
        for req in self.scheduler.running:
            p = req.sampling_params
            if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 \
                    or req.num_output_tokens < p.min_tokens or p.structured_outputs is not None:
                return True
        return False
