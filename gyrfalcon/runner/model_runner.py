"""ModelRunner: loads the model, allocates the paged KV cache, executes one scheduled batch."""

from __future__ import annotations

import functools
import logging
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from gyrfalcon.distributed import GraphCaptureFailed, warm_up_collectives
from gyrfalcon.forward_context import forward_context
from gyrfalcon.kernels.argmax import greedy_argmax
from gyrfalcon.kernels.gated_delta.saves import save_table, state_saves_from_table
from gyrfalcon.models.loader import load_model
from gyrfalcon.runner.cuda_graph import MAX_VERIFY_TOKENS, CudaGraphRunner, capture_sizes
from gyrfalcon.runner.forward_batch import ForwardBatch, build_forward_batch, pack_host_batch
from gyrfalcon.runner.mixed_graph import MixedGraphRunner
from gyrfalcon.runner.kv_cache import CachePlan, copy_states, model_cache_specs
from gyrfalcon.runner.precompile import precompile
from gyrfalcon.runner.request_state import RequestStates
from gyrfalcon.runner.sampler import Sampler, SamplingMetadata
from gyrfalcon.runner.structured_output import StructuredOutputs
from gyrfalcon.spec_decode import build_proposer
from gyrfalcon.step_io import RunnerOutput

logger = logging.getLogger(__name__)

# The share of the GPU's memory the linear-attention layers' verify-graph scratch may take from the KV cache
# (ModelRunner._allocate_verify_scratch).
VERIFY_SCRATCH_SHARE = 0.04


def verify_scratch_rows(ladder: List[int], row_bytes: int, budget: float) -> int:
    """The largest verify-ladder size whose scratch (row_bytes a row) fits the budget; 0 when not even one row does."""
    fits = [s for s in ladder if s * row_bytes <= budget]
    return fits[-1] if fits else 0


@dataclass
class StepHandle:
    """A launched step: its batch, its rows (the runner's view of each scheduled request) and the device
    tensors its results will come from."""

    batch: Any
    rows: list = field(default_factory=list)  # batch.reqs, each with its RequestState attached
    sampled: Optional[torch.Tensor] = None  # [S] int64 on the device
    sampler_out: Any = None  # SamplerOutput when logprobs were asked for
    host: Optional[torch.Tensor] = None  # pinned copy of `sampled` (CUDA)
    event: Any = None  # recorded after the copy (CUDA)
    # prompt_logprobs: ([(batch row, number of entries)], logprob [R], rank [R], top ids / logprobs [R, k])
    prompt_lp: Any = None
    # The target's aux hidden states of every token of the step (EAGLE-3 drafts), [T, 3 * hidden].
    aux_hidden: Optional[torch.Tensor] = None


def start_device_init(device: str) -> Optional[threading.Thread]:
    """Begin creating the CUDA context in a background thread when `device` ("cuda", or "auto" on a machine with
    a GPU) will need one, so that it overlaps what precedes the runner (transformers' import and the config,
    the tokenizer); returns the thread, or None. Nothing waits for it: the runner's first CUDA call finds the
    context made, or blocks in torch's lazy CUDA init until it is (that init is locked)."""
    if device not in ("auto", "cuda") or not torch.cuda.is_available():
        return None

    def init():
        try:
            torch.empty(1, device="cuda")
        except Exception:  # the runner's own first CUDA call reports whatever this hit
            logger.debug("early CUDA context creation failed", exc_info=True)
    t = threading.Thread(target=init, name="gyrfalcon-device-init", daemon=True)
    t.start()
    return t


def profile_step(model, n: int, sample_rows: int, caches, block_size: int, device: torch.device,
                 state_snapshots=None) -> None:
    """The largest step a startup runs eagerly (ModelRunner's activation profile): one prompt of n tokens
    in `caches` (blocks 0..), then logits and a softmax for its first `sample_rows` rows. With state_snapshots
    (a hybrid model's snapshot pools, one snapshot), the step also saves the state after its last token into
    snapshot 0, as a prefix-caching step does: the kernels' saving variants compile at startup too."""
    blocks = -(-n // block_size)
    saves = None
    if state_snapshots is not None:  # one save: sequence 0, row n - 1, snapshot 0
        table = torch.from_numpy(save_table([(0, n - 1, 0)], np.array([0, n])))
        saves = state_saves_from_table(table.to(device), 1, 1)
    fb = ForwardBatch(
        input_ids=torch.zeros(n, dtype=torch.int64, device=device),
        positions=torch.arange(n, device=device), slot_mapping=torch.arange(n, device=device),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        block_tables=torch.arange(blocks, dtype=torch.int32, device=device).unsqueeze(0),
        logits_indices=torch.arange(min(n, sample_rows), device=device),
        is_decode=False, max_query_len=n, max_seq_len=n, num_seqs=1,
        state_slots=torch.zeros(1, dtype=torch.int32, device=device),  # (`caches` has one state slot)
        state_saves=saves)
    with torch.inference_mode(), forward_context(fb, caches, state_snapshots):
        hidden = model(fb.input_ids, fb.positions)
        model.compute_logits(hidden[fb.logits_indices]).softmax(-1)


class ModelRunner:
    def __init__(self, config) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.block_size = config.cache_config.block_size
        self.dtype = config.model_config.torch_dtype
        self.kv_dtype = config.cache_config.kv_torch_dtype(self.dtype)
        # Seconds of each startup phase (benchmarks print them: what a cold start spends where).
        self.startup_phases: Dict[str, float] = {}
        clock = self._phase_clock()
        if self.device.type == "cuda":
            torch.zeros(1, device=self.device)  # the CUDA context, apart from the load
            clock("device_init")
        self.model = load_model(config.model_config, config.device)
        clock("load")
        specs = model_cache_specs(self.model, self.kv_dtype)
        # A draft proposer (speculative decoding): propose(rows, sampled) -> draft tokens per row
        # (gyrfalcon/spec_decode/; None: no speculation, or one a test sets). A draft model's K/V joins the plan
        # as one more paged layer.
        self.proposer = build_proposer(config, self.model, self.device, max(specs, default=-1) + 1)
        if hasattr(self.proposer, "cache_specs"):
            specs.update(self.proposer.cache_specs(str(self.kv_dtype).replace("torch.", "")))
            clock("draft_load")
        self.cache_plan = CachePlan.from_specs(specs, max(specs, default=-1) + 1, self.block_size)
        # One state slot per request that can run at once (linear-attention layers), reserved before the blocks.
        self.num_state_slots = config.scheduler_config.max_num_seqs if self.cache_plan.has_state else 0
        # A verify step advances the linear-attention state past drafts that may be rejected: those layers keep
        # their state after each verify token, and complete() rolls each slot back to the last accepted one.
        self._rollback_layers = []
        self.max_verify_rows: Optional[int] = None  # verify graphs' rows where a static scratch bounds them
        if self.cache_plan.has_state and config.speculative_config.num_speculative_tokens:
            self._rollback_layers = [m for m in self.model.modules() if callable(getattr(m, "rollback", None))]
            for m in self._rollback_layers:
                m.verify_len = 1 + config.speculative_config.num_speculative_tokens
            self._allocate_verify_scratch(config)
        # Prefix caching for such layers restores their state from snapshots at block boundaries (a share of the cache
        # memory; engine/snapshot_pool.py decides what they hold).
        snapshots = self.cache_plan.has_state and config.cache_config.enable_prefix_caching
        self.num_blocks, self.num_state_snapshots = self._determine_num_blocks(snapshots)
        self.state_snapshot_stride = self.cache_plan.snapshot_stride(config.cache_config.linear_state_snapshot_stride)
        clock("kv_sizing")  # on a GPU: the activation profile, an eager prefill of max_num_batched_tokens
        self.kv_caches = self.cache_plan.allocate(self.num_blocks, self.num_state_slots, self.device)
        self.state_snapshots = self.cache_plan.allocate_snapshots(self.num_state_snapshots, self.device)
        clock("kv_alloc")
        # Per-request state kept across steps from the scheduler's plain-data batches.
        self.states = RequestStates()
        if hasattr(self.proposer, "bind_caches"):
            self.proposer.bind_caches(self.kv_caches, self.block_size)
        # Unseeded rows draw from a stream that this engine's seed fixes (seeded rows use their own).
        self._rng = random.Random(config.model_config.seed)
        self.sampler = Sampler()
        mc = config.model_config
        # Grammars of requests with structured_outputs (nothing is loaded until the first such request).
        self.structured = StructuredOutputs(mc.tokenizer_path, mc.trust_remote_code,
                                            getattr(mc.hf_config, "vocab_size", None))
        # The last launched step's sampled tokens, on the device, and each request's row in them:
        # the next step reads a token from here when the host has not received it yet.
        # (a verify step samples 1 + k rows per request: up to a step's whole token budget)
        sc = config.scheduler_config
        rows = max(sc.max_num_seqs, sc.max_num_batched_tokens, 8)
        self.last_sampled = torch.zeros(rows, dtype=torch.int64, device=self.device)
        self.last_rows: Dict[str, int] = {}
        if self.device.type == "cuda":
            # Two pinned buffers: a step copies its tokens into one while the host reads the other.
            self._pinned = [torch.zeros(rows, dtype=torch.int64, pin_memory=True) for _ in range(2)]
            self._pinned_turn = 0
            # The sampled tokens go to the host on their own stream, after an event on the compute stream, so
            # the copy does not sit between this step's argmax and the next step's kernels.
            self._d2h_stream = torch.cuda.Stream(self.device)
            self._sampled_event = torch.cuda.Event()  # reused: the side stream's wait takes its latest record
        self.graph_runner: Optional[CudaGraphRunner] = None
        # A model whose layers cannot run inside a captured graph yet (the linear-attention reference ops loop over
        # sequences on the host) runs every step eagerly.
        graphs = self._graphs_wanted(config)
        if graphs:
            warm_up_collectives(self.device)  # (tensor parallel: NCCL's communicator before any capture)
            k = config.speculative_config.num_speculative_tokens
            self.graph_runner = CudaGraphRunner(
                self.model, self.kv_caches, config.scheduler_config.max_num_seqs,
                config.model_config.max_model_len, self.block_size, self.device, self.last_sampled,
                # (hybrid models' verify steps keep their per-token states in the layers' static scratch)
                query_lens=(1, 1 + k) if k and self._verify_graphs_capturable() else (1,),
                state_padding_slot=self.cache_plan.padding_slot(self.num_state_slots) if self.cache_plan.has_state
                else None, max_verify_rows=self.max_verify_rows)
            graphs = self._capture_or_fall_back(self.graph_runner)
            if not graphs:
                self.graph_runner = None
            clock("decode_graphs")
            if callable(getattr(self.proposer, "capture_graphs", None)):  # a draft model's passes (spec_decode/)
                self.proposer.capture_graphs(self.graph_runner)
                clock("draft_graphs")
        self.mixed_graph_runner: Optional[MixedGraphRunner] = None
        # A draft over the target's hidden states reads every prompt token's: the mixed graphs, like the decode and
        # verify graphs, then return each token's aux hidden states beside the sampled rows.
        if graphs and getattr(self.model, "supports_mixed_graphs", True) and not self._rollback_layers:
            self.mixed_graph_runner = self._mixed_graph_runner()
            if not self._capture_or_fall_back(self.mixed_graph_runner):
                self.mixed_graph_runner = None
            clock("prefill_graphs")
        logger.info("model loaded in %.1f s; caches: %s; CUDA graphs: %s", self.load_seconds,
                    self.cache_plan.describe(self.num_blocks, self.num_state_slots,
                                             config.model_config.max_model_len, self.num_state_snapshots,
                                             self.state_snapshot_stride),
                    f"{len(self.graph_runner.sizes)} sizes captured in {self.graph_runner.capture_seconds:.1f} s"
                    if self.graph_runner else "off")

    @property
    def load_seconds(self) -> float:
        return self.startup_phases["load"]

    def _phase_clock(self):
        """clock(name) -> seconds since the last call (or creation), also stored in startup_phases[name]; on a
        GPU after a sync, so that a phase's queued work counts in that phase."""
        last = [time.perf_counter()]

        def clock(name: str) -> float:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            now = time.perf_counter()
            self.startup_phases[name] = now - last[0]
            last[0] = now
            return self.startup_phases[name]
        return clock

    def _graphs_wanted(self, config) -> bool:
        """Whether decode (and verify) steps will try CUDA graphs (the capture may still fall back)."""
        return (self.device.type == "cuda" and not config.enforce_eager
                and getattr(self.model, "supports_cuda_graphs", True))

    def _allocate_verify_scratch(self, config) -> None:
        """The rollback layers' static scratch for verify graphs (layers/gated_deltanet.py), allocated before the KV
        cache is sized, so the cache leaves room for it; eager runs (CPU, enforce_eager) allocate per step instead.
        Its rows: the largest verify-ladder size whose scratch fits VERIFY_SCRATCH_SHARE of the GPU's memory (one
        row of Qwen3-Next-80B at k = 3 is 3 fp32 states of 2 MiB in each of 36 layers, 216 MiB: the full ladder's
        128 rows would take 27 GiB from the KV cache); verify steps of more rows run eagerly, and a model whose
        single row does not fit keeps all its verify steps eager."""
        if not self._graphs_wanted(config):
            return
        layers = [m for m in self._rollback_layers if callable(getattr(m, "allocate_verify_scratch", None))]
        if not layers:
            return
        q = 1 + config.speculative_config.num_speculative_tokens
        ladder = capture_sizes(min(config.scheduler_config.max_num_seqs, MAX_VERIFY_TOKENS // q))
        per_row = sum(m.verify_scratch_row_bytes() for m in layers)
        budget = VERIFY_SCRATCH_SHARE * torch.cuda.get_device_properties(self.device).total_memory
        rows = verify_scratch_rows(ladder, per_row, budget)
        if rows == 0:
            logger.info("verify steps run eagerly: one row's linear-attention state scratch (%.2f GiB) exceeds "
                        "%.0f%% of the GPU's memory", per_row / 2**30, 100 * VERIFY_SCRATCH_SHARE)
            return
        nbytes = sum(m.allocate_verify_scratch(rows, self.device) for m in layers)
        self.max_verify_rows = rows
        logger.info("verify-step state scratch of the linear-attention layers: %d rows, %.2f GiB", rows,
                    nbytes / 2**30)

    def _verify_graphs_capturable(self) -> bool:
        """Verify steps can replay graphs when no layer rolls back, or every rollback layer keeps its per-token
        states in a static scratch."""
        return all(getattr(m, "verify_scratch", None) is not None for m in self._rollback_layers)

    def _capture_or_fall_back(self, graph_runner) -> bool:
        """graph_runner.capture(); False (its steps then run eagerly) when some tensor-parallel rank could not
        capture a graph: every rank gets GraphCaptureFailed at the same point (distributed/graph_capture.py), so
        all fall back together. Elsewhere a capture error propagates."""
        try:
            graph_runner.capture()
        except GraphCaptureFailed as err:
            # (its graphs' memory goes back to the allocator's cache when the caller drops the runner)
            logger.warning("%s: %s steps run eagerly on every rank", err, type(graph_runner).__name__)
            return False
        return True

    def _mixed_graph_runner(self) -> MixedGraphRunner:
        sc = self.config.scheduler_config
        return MixedGraphRunner(self.model, self.kv_caches, sc.max_num_batched_tokens, sc.max_num_seqs,
                                self.config.model_config.max_model_len, self.block_size, self.device,
                                self.last_sampled)

    # ---- memory ---------------------------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id holds over every paged layer."""
        return self.cache_plan.bytes_per_block

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a sampling row needs past its tokens (a draft model's chained passes write them)."""
        return getattr(self.proposer, "num_lookahead_tokens", 0)

    @property
    def proposes_drafts(self) -> bool:
        """Whether each step's output carries draft tokens for the next (the engine then waits for it)."""
        return self.proposer is not None

    def _determine_num_blocks(self, snapshots: bool = False) -> tuple:
        """(KV blocks, state snapshots: SNAPSHOT_MEMORY_SHARE of the cache memory when `snapshots`, else 0)."""
        cc = self.config.cache_config
        if cc.num_gpu_blocks is not None:
            return cc.num_gpu_blocks, self.cache_plan.snapshots_beside(cc.num_gpu_blocks) if snapshots else 0
        state_bytes = (self.num_state_slots + 1) * self.cache_plan.bytes_per_slot if self.num_state_slots else 0
        if self.device.type == "cpu":
            num_blocks, num_snapshots = self.cache_plan.split_budget(
                int(cc.cpu_kv_cache_gb * (1 << 30) - state_bytes), snapshots)
            # No more blocks than max_num_seqs requests of max_model_len tokens (and their drafts) hold at once: a
            # tiny model's 1 GiB would be ~500k blocks, zeroed (~1 s) and queued (~0.5 s) at every engine start
            # for nothing but a longer-lived prefix cache. A real model's 1 GiB is far below this bound.
            per_seq = self.config.model_config.max_model_len + self.num_lookahead_tokens \
                + (self.config.speculative_config.num_speculative_tokens or 0)
            per_seq_blocks = -(-per_seq // self.block_size) + 1  # + 1: a verify step's rows past a hand-set proposer
            num_blocks = min(num_blocks, self.config.scheduler_config.max_num_seqs * per_seq_blocks)
            return num_blocks, min(num_snapshots, num_blocks)
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info(self.device)
        peak = self._profile_activation_peak(snapshots)
        budget = total * cc.gpu_memory_utilization - (total - free) - peak - state_bytes
        if budget < self.bytes_per_block:
            raise RuntimeError(
                f"No memory left for the KV cache: {total / 2**30:.1f} GiB on the GPU, "
                f"{(total - free) / 2**30:.1f} GiB in use, {peak / 2**30:.1f} GiB of activations; "
                "raise gpu_memory_utilization or lower max_num_batched_tokens.")
        return self.cache_plan.split_budget(int(budget), snapshots)

    def _profile_activation_peak(self, snapshots: bool = False) -> int:
        """Peak extra memory of the largest step: a prefill of max_num_batched_tokens tokens (saving a state
        snapshot when `snapshots`: hybrid prefix caching; the variants without saves are compiled too)."""
        sc = self.config.scheduler_config
        n = min(sc.max_num_batched_tokens, self.config.model_config.max_model_len)
        blocks = -(-n // self.block_size)
        caches = self.cache_plan.allocate(blocks, 1, self.device)  # (the peak is measured above them)
        snaps = self.cache_plan.allocate_snapshots(1, self.device) if snapshots else None
        step = functools.partial(profile_step, self.model, n, sc.max_num_seqs, caches, self.block_size, self.device,
                                 snaps)
        plain = functools.partial(profile_step, self.model, n, sc.max_num_seqs, caches, self.block_size, self.device)
        # Its kernels compile in threads first (runner/precompile.py).
        precompile([step, plain] if snapshots else [step])
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del caches, snaps, step, plain
        torch.cuda.empty_cache()
        return int(peak * 1.1)

    # ---- one step -------------------------------------------------------------------------------
    def execute(self, batch) -> RunnerOutput:
        """Run one step and wait for its tokens."""
        return self.complete(self.launch(batch))

    @torch.inference_mode()
    def launch(self, batch) -> StepHandle:
        """Queue one step on the device without waiting for it: forward, logits, sampling, and an
        asynchronous copy of the sampled tokens to the host. A token the previous step sampled
        that the host has not seen yet is read on the device from `last_sampled`."""
        rows = self.states.apply(batch)
        self.structured.update(batch)
        handle = StepHandle(batch, rows)
        if not rows:
            return handle
        if batch.state_restores:  # prefix hits of hybrid models: the cached prefix's state into the request's slot
            copy_states(self.state_snapshots, self.kv_caches, batch.state_restores, self.device)
        # One sampled row per sampling request, 1 + k on a verify step; j: the row's index among them.
        # drafts_before: per row, the drafts ahead of it in its verify step (its history's tail: penalties and
        # min_tokens count them, as one-token steps would have).
        sample_reqs, sample_j, drafts_before = [], [], []
        for r in rows:
            if r.sample:
                st = r.request
                st.num_inflight += 1
                if r.spec_token_ids:
                    for j in range(1 + len(r.spec_token_ids)):
                        sample_reqs.append(st)
                        sample_j.append(j)
                        drafts_before.append(r.spec_token_ids[:j])
                else:
                    sample_reqs.append(st)
                    sample_j.append(0)
                    drafts_before.append(())
        # prompt_logprobs need every row's hidden state: such steps run eagerly.
        plp_rows = self._prompt_logprob_rows(rows)
        # A step that writes state snapshots (hybrid prefix caching, prefill chunks only) runs eagerly: its save
        # rows are no static input of a captured graph.
        eager = bool(plp_rows) or bool(batch.state_saves)
        if not eager and self.graph_runner is not None and self.graph_runner.can_run(rows):
            # Every row samples (a decode step, or a verify step: all 1 + k rows).
            hidden = self.graph_runner.run(rows, self.last_rows)
            if getattr(self.proposer, "uses_target_hidden", False):
                handle.aux_hidden = self.model.model.aux_hidden
        elif not eager and self.mixed_graph_runner is not None and self.mixed_graph_runner.can_run(rows):
            # A prefill (maybe with decodes) small enough for a captured graph: the sampled rows only.
            hidden = self.mixed_graph_runner.run(pack_host_batch(rows, self.block_size, self.last_rows))
            if getattr(self.proposer, "uses_target_hidden", False):
                handle.aux_hidden = self.model.model.aux_hidden
        else:
            fb = build_forward_batch(rows, self.block_size, self.device, self.last_rows, self.last_sampled,
                                     batch.state_saves)
            with forward_context(fb, self.kv_caches, self.state_snapshots):
                hidden = self.model(fb.input_ids, fb.positions)
            if getattr(self.proposer, "uses_target_hidden", False):
                handle.aux_hidden = self.model.model.aux_hidden
            if plp_rows:
                handle.prompt_lp = self._prompt_logprobs(hidden, rows, plp_rows)
            hidden = hidden[fb.logits_indices] if sample_reqs else None
        if not sample_reqs:
            if handle.prompt_lp is not None and self.device.type == "cuda":
                handle.event = torch.cuda.Event()
                handle.event.record()
            return handle
        # Logits in the weights' dtype: a greedy argmax or a bare draw needs no fp32 copy, and the Sampler
        # makes one where it does need it.
        logits = self.model.compute_logits(hidden, fp32=False)
        n = logits.shape[0]
        if self._plain_greedy(sample_reqs):
            handle.sampled = greedy_argmax(logits)  # the common case: no metadata
            self.last_sampled[:n].copy_(handle.sampled)
        else:
            md = self._sampling_metadata(sample_reqs, sample_j, drafts_before)
            # The host fills the grammar masks while the device runs the queued forward and LM head.
            mask = self.structured.bitmask(rows)
            if mask is not None:
                md.token_bitmask = (torch.tensor(mask[0], device=self.device),
                                    mask[1].to(self.device, non_blocking=True))
            out = self.sampler(logits, md)
            handle.sampled, handle.sampler_out = out.sampled, out
            self.last_sampled[:n].copy_(handle.sampled)
        # Each request's last sampled row (a verify step's next token is only known after verification, on
        # the host: the engine waits for those steps, so no later step reads it from here).
        self.last_rows = {r.request_id: i for i, r in enumerate(sample_reqs)}
        if self.device.type == "cuda":
            self._pinned_turn ^= 1
            handle.host = self._pinned[self._pinned_turn][:n]
            handle.event = torch.cuda.Event()
            self._sampled_event.record()
            self._d2h_stream.wait_event(self._sampled_event)
            with torch.cuda.stream(self._d2h_stream):
                handle.host.copy_(handle.sampled, non_blocking=True)
                handle.event.record(self._d2h_stream)
            # The allocator must not hand the tokens' memory to the compute stream before the copy ran.
            handle.sampled.record_stream(self._d2h_stream)
        return handle

    @torch.inference_mode()
    def capture_hidden_states(self, sequences: Sequence[Sequence[int]], aux_layers: Sequence[int]) -> List[tuple]:
        """One eager prefill of whole sequences outside the scheduler (draft training: gyrfalcon/train/), all of
        them in one varlen batch -> per sequence (aux [T, len(aux_layers) * hidden]: the residual stream entering
        each of aux_layers, ascending, as the EAGLE-3 proposer reads it; final [T, hidden]: the final-normed hidden
        state, compute_logits' input), on the device. Sequence i owns blocks of its own and state slot i, so
        sequences see nothing of each other; batching them only saves launches (a 300-token sequence alone is a
        few milliseconds of launch-bound layers). It runs in caches of its own (profile_step's pattern), so the
        requests' blocks and the prefix cache stay untouched; the target's own aux layers (a running EAGLE-3
        proposer) are restored after."""
        seqs = [list(s) for s in sequences]
        layers = tuple(sorted(set(int(i) for i in aux_layers)))
        if not seqs or any(not s for s in seqs) or not layers:
            raise ValueError("capture_hidden_states needs non-empty sequences and at least one aux layer.")
        lens = [len(s) for s in seqs]
        bs, dev = self.block_size, self.device
        nblocks = [-(-n // bs) for n in lens]
        first = [0]
        for b in nblocks:
            first.append(first[-1] + b)
        caches = self.cache_plan.allocate(first[-1], len(seqs) if self.cache_plan.has_state else 0, dev)
        width = max(nblocks)
        table = torch.zeros(len(seqs), width, dtype=torch.int32)
        for i, b in enumerate(nblocks):
            table[i, :b] = torch.arange(first[i], first[i] + b, dtype=torch.int32)
        # Sequence i's token t sits in its own blocks, which are contiguous: slot first[i] * bs + t.
        slots = torch.cat([torch.arange(n) + first[i] * bs for i, n in enumerate(lens)])
        cu = torch.tensor([0] + lens).cumsum(0)
        total = int(cu[-1])
        fb = ForwardBatch(
            input_ids=torch.tensor([t for s in seqs for t in s], dtype=torch.int64, device=dev),
            positions=torch.cat([torch.arange(n) for n in lens]).to(dev), slot_mapping=slots.to(dev),
            query_start_loc=cu.to(dev, torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_tables=table.to(dev), logits_indices=torch.arange(total, device=dev), is_decode=False,
            max_query_len=max(lens), max_seq_len=max(lens), num_seqs=len(seqs),
            state_slots=torch.arange(len(seqs), dtype=torch.int32, device=dev))
        inner = self.model.model
        saved = (inner.aux_hidden_layers, inner.aux_hidden)
        inner.aux_hidden_layers = layers
        try:
            with forward_context(fb, caches):
                final = self.model(fb.input_ids, fb.positions)
            aux = inner.aux_hidden
        finally:
            inner.aux_hidden_layers, inner.aux_hidden = saved
        return list(zip(aux.split(lens), final.split(lens)))

    def complete(self, handle: StepHandle) -> RunnerOutput:
        """Wait for a launched step and return its tokens (and logprobs) per scheduled request; the tokens
        join the runner's own request state. On a verify step a request keeps its drafts up to the first
        that differs from the token sampled at that position, then the sampled one.

        Why that is lossless. Row j of a verify step samples x_j from p_j, the target's distribution after the
        prefix and drafts d_0..d_{j-1}, processed as a one-token step would process it (penalties and min_tokens
        count those drafts, the same temperature / top-k / top-p, a seeded request the same random stream at
        output index + j). While every earlier draft was kept, that prefix IS the sequence so far, and the
        token emitted at j is x_j itself (kept draft d_j == x_j, or x_j at the first mismatch): a draw from p_j,
        exactly what one-token steps emit. It is also speculative sampling's rule min(1, p(d)/q(d)) for greedy
        drafting, where q is one-hot on d: d is kept with probability P(x_j = d) = p_j(d) = min(1, p_j(d)/1),
        and on rejection x_j is distributed as p_j given x_j != d, i.e. the normalized max(p_j - q, 0).
        (Drafts drawn from a non-degenerate q would need the general rule: none are.)
        tests/spec_decode/test_sampled.py checks it: exact equality for seeded requests, a chi-square bound on
        the per-position distributions of unseeded ones."""
        rows = handle.rows
        # () where a request has nothing: no empty list per request per step (a 768-sequence decode batch
        # would hand the garbage collector thousands of them a step).
        sampled: list = [()] * len(rows)
        logprobs: list = [()] * len(rows)
        prompt_lps = self._prompt_logprob_lists(handle) if handle.prompt_lp is not None else None
        if handle.sampled is None:
            if handle.event is not None:
                handle.event.synchronize()
            if handle.aux_hidden is not None:  # prefill chunks: the draft's cache still covers them
                self.proposer.set_step(handle.aux_hidden)
                self.proposer.propose(rows, sampled)
            return RunnerOutput(sampled, logprobs, prompt_lps)
        if handle.event is not None:
            handle.event.synchronize()
            tokens = handle.host.tolist()
        else:
            tokens = handle.sampled.tolist()
        out = handle.sampler_out
        lp = rank = top_ids = top_lps = None
        if out is not None and out.sampled_logprob is not None:
            lp, rank = out.sampled_logprob.tolist(), out.sampled_rank.tolist()
            if out.top_ids is not None:
                top_ids, top_lps = out.top_ids.tolist(), out.top_logprobs.tolist()
        row = 0
        rollbacks = []  # (sequence in the step, state slot, tokens kept) of verify rows with rejected drafts
        for i, r in enumerate(rows):
            if not r.sample:
                continue
            st = r.request
            st.num_inflight -= 1
            drafts = r.spec_token_ids
            n_keep = 0
            while n_keep < len(drafts) and drafts[n_keep] == tokens[row + n_keep]:
                n_keep += 1
            kept = tokens[row:row + n_keep + 1]
            if drafts and n_keep < len(drafts) and self._rollback_layers:  # the state after the last kept token
                rollbacks.append((i, st.state_slots["state"], 1 + n_keep))
            sampled[i] = kept
            st.output_token_ids.extend(kept)
            self.structured.accept(st, kept)
            n = st.sampling_params.logprobs
            if n is not None and lp is not None:
                logprobs[i] = [(lp[x], rank[x], list(zip(top_ids[x][:n], top_lps[x][:n])) if n > 0 else [])
                               for x in range(row, row + len(kept))]
            row += r.num_sampled_rows
        if rollbacks:  # one gather per layer's pool, before any later step reads the slots
            idx = torch.tensor(rollbacks, dtype=torch.int64).t().to(self.device)
            for m in self._rollback_layers:
                m.rollback(self.kv_caches, idx[0], idx[1], idx[2])
        if handle.aux_hidden is not None:
            self.proposer.set_step(handle.aux_hidden)
        spec = self.proposer.propose(rows, sampled) if self.proposer is not None else None
        return RunnerOutput(sampled, logprobs, prompt_lps, spec)

    # ---- prompt logprobs ------------------------------------------------------------------------
    @staticmethod
    def _prompt_logprob_rows(sched_reqs) -> List[tuple]:
        """[(batch row, first token row in the step, number of prompt tokens to score)] for the requests
        that asked for prompt_logprobs and run prompt positions whose next token is a prompt token."""
        rows, t0 = [], 0
        for i, sr in enumerate(sched_reqs):
            req = sr.request
            if req.sampling_params.prompt_logprobs is not None:
                n = min(sr.start + sr.num_new_tokens, req.num_prompt_tokens - 1) - sr.start
                if n > 0:
                    rows.append((i, t0, n))
            t0 += sr.num_new_tokens
        return rows

    def _prompt_logprobs(self, hidden: torch.Tensor, sched_reqs, plp_rows, chunk: int = 512):
        """Raw logprob and rank of each scored prompt token, and the top-k (k: the largest asked),
        computed in slices of `chunk` rows so a long prompt never holds [T, vocab] logits at once."""
        dev = hidden.device
        idx, targets, k = [], [], 0
        for i, t0, n in plp_rows:
            sr = sched_reqs[i]
            idx.extend(range(t0, t0 + n))
            targets.extend(sr.request.prompt_token_ids[sr.start + 1:sr.start + 1 + n])
            k = max(k, sr.request.sampling_params.prompt_logprobs)
        idx_t = torch.tensor(idx, device=dev)
        tgt_t = torch.tensor(targets, device=dev)
        lps, ranks, top_ids, top_lps = [], [], [], []
        for a in range(0, len(idx), chunk):
            lsm = self.model.compute_logits(hidden[idx_t[a:a + chunk]]).float().log_softmax(dim=-1)
            lp = lsm.gather(1, tgt_t[a:a + chunk].unsqueeze(1)).squeeze(1)
            lps.append(lp)
            ranks.append((lsm > lp.unsqueeze(1)).sum(dim=-1) + 1)
            if k > 0:
                v, ids = lsm.topk(k, dim=-1)
                top_lps.append(v)
                top_ids.append(ids)
        return ([(i, n) for i, _, n in plp_rows], torch.cat(lps), torch.cat(ranks),
                torch.cat(top_ids) if k > 0 else None, torch.cat(top_lps) if k > 0 else None)

    def _prompt_logprob_lists(self, handle: StepHandle) -> List[Optional[list]]:
        segments, lp, rank, top_ids, top_lps = handle.prompt_lp
        if handle.event is not None:
            handle.event.synchronize()
        lp, rank = lp.tolist(), rank.tolist()
        top_ids = top_ids.tolist() if top_ids is not None else None
        top_lps = top_lps.tolist() if top_lps is not None else None
        out: List[Optional[list]] = [None] * len(handle.rows)
        r = 0
        for i, n in segments:
            k = handle.rows[i].request.sampling_params.prompt_logprobs
            out[i] = [(lp[j], rank[j], list(zip(top_ids[j][:k], top_lps[j][:k])) if k else [])
                      for j in range(r, r + n)]
            r += n
        return out

    @staticmethod
    def _plain_greedy(reqs) -> bool:
        for r in reqs:
            p = r.sampling_params
            if not p.greedy or p.logprobs is not None or p.logit_bias or p.structured_outputs is not None \
                    or p.presence_penalty \
                    or p.frequency_penalty or p.repetition_penalty != 1.0 or r.num_output_tokens < p.min_tokens:
                return False
        return True

    def _random_streams(self, reqs, params, draft_index: List[int]) -> List[List[int]]:
        """[seeds, offsets] per row for kernels/sampling.py. A seeded request: its seed, and the index
        of the output token this row draws (tokens still in flight count: async scheduling; a verify
        step's j-th row draws output token + j), so its draws depend on nothing else. Unseeded rows: this
        step's stream, one offset per row."""
        base = self._rng.getrandbits(62)
        seeds, offsets = [], []
        for i, (r, p, j) in enumerate(zip(reqs, params, draft_index)):
            if p.seed is None:
                seeds.append(base)
                offsets.append(i)
            else:
                seeds.append(p.seed & (2**63 - 1))
                offsets.append(r.num_output_tokens + r.num_inflight - 1 + j)
        return [seeds, offsets]

    def _sampling_metadata(self, reqs, draft_index: Optional[List[int]] = None,
                           drafts_before: Optional[list] = None) -> SamplingMetadata:
        """reqs: the RequestState of each sampled row (a verify step's request once per row); draft_index:
        each row's index within its request's rows (0 outside verify steps); drafts_before: the drafts ahead of
        each row in its verify step, which its penalties and min_tokens count as outputs."""
        draft_index = draft_index if draft_index is not None else [0] * len(reqs)
        drafts_before = drafts_before if drafts_before is not None else [()] * len(reqs)
        dev = self.device
        params = [r.sampling_params for r in reqs]
        temps = [0.0 if p.greedy else p.temperature for p in params]
        all_greedy = all(t == 0.0 for t in temps)
        # Two host-to-device copies for all the per-row scalars.
        floats = torch.tensor([temps, [p.top_p for p in params], [p.min_p for p in params]],
                              dtype=torch.float32).to(dev, non_blocking=True)
        ints = torch.tensor([[p.top_k for p in params]] + self._random_streams(reqs, params, draft_index),
                            dtype=torch.int64).to(dev, non_blocking=True)
        md = SamplingMetadata(
            temperature=floats[0], top_p=floats[1], min_p=floats[2], top_k=ints[0],
            all_greedy=all_greedy, all_random=all(t > 0.0 for t in temps),
            need_top_p=any(p.top_p < 1.0 for p in params),
            need_top_k=any(p.top_k > 0 for p in params),
            need_min_p=any(p.min_p > 0.0 for p in params),
            seeds=ints[1], offsets=ints[2], unit_temperature=all(t == 1.0 for t in temps))
        if any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in params):
            md.output_token_ids = [r.output_token_ids + list(d) if d else r.output_token_ids
                                   for r, d in zip(reqs, drafts_before)]
            md.prompt_token_ids = [r.prompt_token_ids for r in reqs]
            md.presence_penalty = torch.tensor([p.presence_penalty for p in params], device=dev)
            md.frequency_penalty = torch.tensor([p.frequency_penalty for p in params], device=dev)
            md.repetition_penalty = torch.tensor([p.repetition_penalty for p in params], device=dev)
        masks = []
        for r, p, j in zip(reqs, params, draft_index):
            ids: List[int] = []
            if r.num_output_tokens + j < p.min_tokens:
                ids = list(p.stop_token_ids) + ([] if p.ignore_eos else list(r.eos_token_ids))
            masks.append(ids)
        if any(masks):
            md.min_tokens_mask = masks
        if any(p.logit_bias for p in params):
            rows, ids, values = [], [], []
            for i, p in enumerate(params):
                for t, v in (p.logit_bias or {}).items():
                    rows.append(i)
                    ids.append(t)
                    values.append(v)
            md.logit_bias = (torch.tensor(rows, device=dev), torch.tensor(ids, device=dev),
                             torch.tensor(values, dtype=torch.float32, device=dev))
        asked = [p.logprobs for p in params if p.logprobs is not None]
        if asked:
            md.max_num_logprobs = max(asked)
        return md
