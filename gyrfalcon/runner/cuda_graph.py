"""CUDA graphs for decode steps: the whole model forward (attention included) replayed as one graph.

The GPU host is slow (~24 us per eager launch), and a decode step of a small model launches
hundreds of kernels; replaying a captured graph costs one launch. Graphs are captured once per
batch size of a ladder (1, 2, 4, 8, 16, 24, ... up to max_num_seqs); a batch of n sequences
replays the smallest captured size >= n, the extra rows padded so they do nothing: slot -1 (the
KV store skips it) and seq_len 0 (decode attention writes zeros without reading the cache).

Every graph reads its inputs from one set of static device buffers. The host fills a pinned
staging copy of them and sends them in one copy, so preparing a step costs a handful of launches
whatever the batch size. A graph returns the hidden states [b, hidden]; the runner applies the LM head
and samples outside it.

The attention backend (layers/attention: graph_variants) names the small sizes that get a second graph whose
decode attention runs one split per sequence (no split merge: one launch per layer fewer) and the context up to
which a batch replays it; capture_metadata gives the batch such a graph captures.

Verify steps of speculative decoding (b sequences of 1 + k tokens, every row sampled) replay graphs of their
own, keyed like the others by (number of tokens, query length), for each k the config asks for.

Under tensor parallelism the steps' all-reduces are captured too (NCCL kernels in the graph): every rank captures
the same ladder (from the config) and the ranks agree after each capture that all of them captured it
(distributed/graph_capture.py).

Models with linear-attention layers (Gated DeltaNet) find each row's state slot in a static state_slots input too
(ForwardBatch.state_slots): the kernels gather and update the state pools through it inside the graph. Padding rows
point at the pools' spare padding slot (runner/kv_cache.py allocates one past the slots requests hold): their
decode step writes a state like any row's, and must not write it into a request's slot. Their verify graphs also
write each row's state after every verify token into the layers' static scratch (layers/gated_deltanet.py), from
which the runner rolls rejected rows back after the step; padding rows (no tokens of their own) fill scratch
rows that no rollback reads.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Callable, Dict, List, Optional

import numpy as np
import torch

from gyrfalcon.distributed import agreed_capture, capture_error_mode, ranks_agree
from gyrfalcon.forward_context import forward_context
from gyrfalcon.kernels.common import pdl_disabled, pdl_mode, pdl_possible, pdl_warmup
from gyrfalcon.layers.attention import get_backend
from gyrfalcon.runner.forward_batch import ForwardBatch
from gyrfalcon.runner.kv_cache import first_attention_cache
from gyrfalcon.runner.precompile import ladder_warmup_steps, precompile

logger = logging.getLogger(__name__)


MAX_CAPTURE_SIZE = 512  # larger decode batches run eagerly: their launches are small next to the GPU's work
# Verify steps' graphs hold up to this many tokens (b * (1 + k)); larger ones run through the mixed or eager path.
MAX_VERIFY_TOKENS = 512


def capture_sizes(max_num_seqs: int) -> List[int]:
    """The batch-size ladder: 1, 2, 4, 8, every multiple of 8 up to 256, then of 16 up to 512, up to
    max_num_seqs (rounded up to the ladder); batches above MAX_CAPTURE_SIZE are not captured."""
    ladder = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, MAX_CAPTURE_SIZE + 1, 16))
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    return [s for s in ladder if s < top] + [next(s for s in ladder if s >= top)]


def padded_size(sizes: List[int], n: int) -> int:
    """The smallest captured size that holds n sequences (n must be <= sizes[-1])."""
    i = bisect.bisect_left(sizes, n)
    if i == len(sizes):
        raise ValueError(f"batch of {n} exceeds the largest captured size {sizes[-1]}")
    return sizes[i]


def _capture(fb, step, kv_caches, pool):
    with forward_context(fb, kv_caches):
        with pdl_warmup():  # compile the kernel variants the capture will launch, outside it
            step()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()

        def capture():
            with torch.cuda.graph(g, pool=pool, capture_error_mode=capture_error_mode()):
                return step()
        # Under tensor parallelism the ranks agree that each captured (distributed/graph_capture.py).
        out = agreed_capture(capture)
    return g, out


def time_replays(graphs: List[torch.cuda.CUDAGraph], reps: int = 15) -> List[float]:
    """Median ms per replay of each graph, replays interleaved (a, b, a, b, ...) so that clock or
    thermal drift hits both alike; each replay timed alone with CUDA events after a warm-up."""
    for g in graphs:
        g.replay()
    times: List[List[float]] = [[] for _ in graphs]
    for _ in range(reps):
        for i, g in enumerate(graphs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            times[i].append(start.elapsed_time(end))
    return [float(np.median(t)) for t in times]


PDL_TIMING_CONTEXT = 1024  # tokens of context in the batch-1 graphs timed for the PDL choice


def capture_ladder(sizes: List[int], kv_caches, prepare, report: Optional[dict] = None,
                   at_context: Optional[Callable[[int], bool]] = None, pool=None,
                   batch1_pdl: Optional[bool] = None) -> tuple:
    """Capture one CUDA graph per size. prepare(size) -> (ForwardBatch over the static inputs, step fn).
    Returns ({size: graph}, {size: step fn's outputs}, seconds). Largest first: the smaller graphs then
    fit in the memory pool the largest one reserved; each step runs once eagerly first (lazy init and
    Triton compilation outside the capture).

    Batch 1 is where the kernels may launch with programmatic dependent launch (kernels/_common.py
    use_pdl). Whether that pays depends on the model (on the H200 it is faster for Qwen3-0.6B and slower for
    Llama-3.1-8B), so with GYRFALCON_PDL unset ("auto") the batch-1 graph is
    captured both ways, timed, and the faster kept; `report` (if given) receives the two times and the
    choice. at_context(ctx) (if given) points the batch-1 static inputs at one token at that context
    (False: it does not fit), so that the timing includes decode attention's work, which the prefetch
    changes with PDL (at seq_len 0, as captured, attention reads nothing); at_context(0) restores them.
    pool: a memory pool to share (another ladder's). batch1_pdl True / False: capture batch 1 that way,
    untimed (a second ladder follows the first one's choice)."""
    t0 = time.perf_counter()
    graphs: Dict[int, torch.cuda.CUDAGraph] = {}
    outputs: Dict[int, object] = {}
    # The kernels compile in threads first (runner/precompile.py).
    precompile(ladder_warmup_steps(sizes, kv_caches, prepare, batch1_pdl))
    for size in reversed(sizes):
        fb, step = prepare(size)
        if size == 1 and batch1_pdl is False:
            with pdl_disabled():
                g, out = _capture(fb, step, kv_caches, pool)
        else:
            g, out = _capture(fb, step, kv_caches, pool)
        pool = g.pool()
        if size == 1 and batch1_pdl is None and pdl_mode() == "auto" and pdl_possible(fb.input_ids):
            with pdl_disabled():
                g_off, out_off = _capture(fb, step, kv_caches, pool)
            ctx = PDL_TIMING_CONTEXT if at_context is not None and at_context(PDL_TIMING_CONTEXT) else 0
            ms_pdl, ms_off = time_replays([g, g_off])
            if ctx:
                at_context(0)
            keep_pdl = ranks_agree(ms_pdl < ms_off)  # (tensor parallel: every rank keeps the same kind)
            if report is not None:
                report.update(batch1_ms_pdl=ms_pdl, batch1_ms_no_pdl=ms_off, batch1_pdl=keep_pdl,
                              batch1_context=ctx)
            logger.info("batch-1 decode graph at %d tokens of context: %.3f ms with programmatic dependent "
                        "launch, %.3f ms without; keeping %s", ctx, ms_pdl, ms_off,
                        "PDL" if keep_pdl else "the graph without it")
            if not keep_pdl:
                g, out = g_off, out_off
        graphs[size], outputs[size] = g, out
    torch.cuda.synchronize()
    return graphs, outputs, time.perf_counter() - t0


class DecodeInputs:
    """Static buffers of a decode step for up to B sequences of q query tokens each (q = 1: a decode step;
    1 + k: a speculative verify step), plus their pinned host staging. T = B * q tokens.

    int64 part: [input_ids T | positions T | slot_mapping T | src T]
    (src[t] >= 0: token t is still on the device, at last_sampled[src[t]]; only where q = 1)
    int32 part: [seq_lens B | query_start_loc B+1 | state_slots S | block_tables W*B]   (W = max blocks per seq;
    S = B with linear-attention layers, whose padding rows hold state_padding_slot, else 0)
    Both parts are views of one buffer, so a step's inputs go to the device in one copy.

    The block table is row-major ([b, W], strides (W, 1)); W follows max_model_len (8,192 blocks for
    Llama-3.1-8B's 131,072 tokens), and a step sends the rows in use up to the width of the widest of them.

    The copy to the device runs on a side stream, ordered by events: in the compute stream it would sit
    between one step's argmax and the next step's kernels (the block table alone is 2 MB a step at batch 64 of
    Llama-3.1-8B); on the side it waits only for the last replay to finish reading the inputs and runs under
    the LM head and argmax.
    """

    def __init__(self, max_batch: int, max_blocks_per_seq: int, device: torch.device, query_len: int = 1,
                 state_padding_slot: Optional[int] = None) -> None:
        B, W, q = max_batch, max_blocks_per_seq, query_len
        self.B, self.W, self.q, self.T = B, W, q, B * q
        self.pad_slot = state_padding_slot
        self.S = B if state_padding_slot is not None else 0
        self.bt = 2 * B + 1 + self.S  # the block table's offset in the int32 part
        n32 = B + (B + 1) + self.S + B * W
        self._words = 4 * self.T + -(-n32 // 2)  # int64 words: the int32 part packed two per word
        self.raw = torch.zeros(self._words, dtype=torch.int64, device=device)
        self.i64, self.i32 = self._split(self.raw, n32)
        # No row's token is pending until a step says so: the captures' warm-up steps (and the parallel
        # compile's, whose Triton outputs are never written) then embed input_ids (zeros) instead of
        # last_sampled[0], which holds whatever the last step left there.
        self.src(B).fill_(-1)
        if self.S:  # (so are the warm-up and capture steps' rows: every row is a padding row then)
            self.i32[2 * B + 1:self.bt].fill_(state_padding_slot)
        pin = device.type == "cuda"
        # Two staging copies, alternated: with async scheduling the host fills step N+1 while step N's
        # non-blocking copy out of the other one may not have run yet.
        self._staging = []
        for _ in range(2):
            hraw = torch.zeros(self._words, dtype=torch.int64, pin_memory=pin)
            h64, h32 = self._split(hraw, n32)
            h32.numpy()[B:2 * B + 1] = np.arange(B + 1) * q  # q queries per sequence, forever
            h32.numpy()[2 * B + 1:self.bt] = -1 if state_padding_slot is None else state_padding_slot
            self._staging.append((hraw, h64.numpy(), h32.numpy()))
        self._turn = 0
        # The copy runs on its own stream once the last replay is done reading the buffers (replayed() marks
        # that), and the compute stream waits for it before the next replay.
        self._copy_stream = self._read_done = self._copied = None
        if pin:
            self._copy_stream = torch.cuda.Stream(device)
            self._read_done, self._copied = torch.cuda.Event(), torch.cuda.Event()

    def _split(self, raw: torch.Tensor, n32: int):
        return raw[:4 * self.T], raw[4 * self.T:].view(torch.int32)[:n32]

    def views(self, b: int) -> ForwardBatch:
        """A ForwardBatch over the first b sequences of the device buffers (what a graph captures)."""
        B, W, q, T = self.B, self.W, self.q, self.T
        table = self.i32[self.bt:].view(B, W)
        return ForwardBatch(
            input_ids=self.i64[:b * q], positions=self.i64[T:T + b * q],
            slot_mapping=self.i64[2 * T:2 * T + b * q], seq_lens=self.i32[:b],
            query_start_loc=self.i32[B:B + b + 1], block_tables=table[:b],
            logits_indices=torch.arange(b * q, device=self.i64.device), is_decode=q == 1,
            max_query_len=q, max_seq_len=W, num_seqs=b,
            uniform_query_len=q, state_slots=self.i32[2 * B + 1:2 * B + 1 + b] if self.S else None)

    def src(self, b: int) -> torch.Tensor:
        return self.i64[3 * self.T:3 * self.T + b * self.q]

    def set_context(self, b: int, ctx: int, block_size: int, num_blocks: Optional[int] = None) -> bool:
        """Point the first b rows of the device buffers at one decode token each at context ctx (row i
        uses cache blocks i * nb .. (i + 1) * nb - 1, token id 0), for timing a graph where attention
        has work (seq_len 0, what the capture leaves, reads nothing); ctx 0 restores that empty state.
        A replay then writes one K/V slot per row into those blocks: only while no request holds them.
        False (nothing written) when ctx does not fit the block-table width or the cache's num_blocks."""
        assert self.q == 1, "only decode graphs are timed at a context"
        nb = -(-ctx // block_size)
        if nb > self.W or (num_blocks is not None and b * nb > num_blocks):
            return False
        fb = self.views(b)
        self.src(b).fill_(-1)
        fb.input_ids.fill_(0)
        fb.seq_lens.fill_(ctx)
        fb.positions.fill_(max(ctx - 1, 0))
        if nb:
            tables = torch.arange(b * nb, dtype=fb.block_tables.dtype, device=fb.block_tables.device)
            fb.block_tables[:, :nb] = tables.view(b, nb)
            fb.slot_mapping.copy_(fb.block_tables[:, nb - 1].long() * block_size + (ctx - 1) % block_size)
        else:
            fb.slot_mapping.fill_(-1)
        return True

    def fill(self, sched_reqs, b: int, block_size: int, last_rows=None) -> int:
        """Write the inputs of `sched_reqs` (ScheduledRequest with its RequestState attached, q tokens each; padded to b sequences) and
        send them; returns n. A token the host does not have yet is marked by its row in the last step's
        samples; a verify step's drafts follow the tokens the request has."""
        B, W, q, T = self.B, self.W, self.q, self.T
        n = len(sched_reqs)
        self._turn ^= 1
        hraw, n64, n32 = self._staging[self._turn]
        # Row-major: block j of row i at i * W + j (bt is the transposed view: bt[j, i]).
        bt = n32[self.bt:].reshape(B, W).T
        if self.S:  # each request's slot in the state pools; padding rows update the padding slot
            ss = n32[2 * B + 1:2 * B + 1 + b]
            ss[:n] = [sr.request.state_slots["state"] for sr in sched_reqs]
            ss[n:] = self.pad_slot
        if q == 1:
            for i, sr in enumerate(sched_reqs):
                req = sr.request
                pos = sr.start
                if pos < req.num_tokens:
                    n64[i] = req.token_id_at(pos)
                    n64[3 * T + i] = -1
                else:
                    n64[i] = 0
                    n64[3 * T + i] = last_rows[req.request_id]
                n64[T + i] = pos
                blocks = req.block_ids
                n64[2 * T + i] = blocks[pos // block_size] * block_size + pos % block_size
                n32[i] = pos + 1
                bt[:len(blocks), i] = blocks
        else:
            for i, sr in enumerate(sched_reqs):
                req, start, t0 = sr.request, sr.start, i * q
                drafts = sr.spec_token_ids
                known = q - len(drafts)
                n64[t0:t0 + known] = req.token_ids(start, start + known)
                n64[t0 + known:t0 + q] = drafts
                n64[3 * T + t0:3 * T + t0 + q] = -1
                pos = np.arange(start, start + q)
                n64[T + t0:T + t0 + q] = pos
                blocks = np.asarray(req.block_ids)
                n64[2 * T + t0:2 * T + t0 + q] = blocks[pos // block_size] * block_size + pos % block_size
                n32[i] = start + q
                bt[:len(blocks), i] = blocks
            # Padding sequences hold no query (their tokens belong to none: slot -1), as in the mixed graphs, so
            # the varlen kernel has nothing to attend for them.
            n32[B:B + n + 1] = np.arange(n + 1) * q
            n32[B + n + 1:B + b + 1] = n * q
        n64[n * q:b * q] = 0
        n64[T + n * q:T + b * q] = 0
        n64[2 * T + n * q:2 * T + b * q] = -1
        n64[3 * T + n * q:3 * T + b * q] = -1
        n32[n:b] = 0
        # One copy, up to the last row of the padded batch: entries past a row's own blocks, or in rows past n,
        # are never read (seq_lens bounds every read; padding rows have seq_len 0).
        words = 4 * T + -(-(self.bt + b * W) // 2)
        if self._copy_stream is None:
            self.raw[:words].copy_(hraw[:words], non_blocking=True)
            return n
        # The last replay may still be reading these buffers: the copy waits for it on the side stream (an event
        # never recorded, before the first replay, waits for nothing), and the next replay waits for the copy.
        self._copy_stream.wait_event(self._read_done)
        with torch.cuda.stream(self._copy_stream):
            self.raw[:words].copy_(hraw[:words], non_blocking=True)
            self._copied.record(self._copy_stream)
        torch.cuda.current_stream(self.raw.device).wait_event(self._copied)
        return n

    def replayed(self) -> None:
        """Mark, on the current stream, the end of a replay that reads these buffers (the side-stream copy waits
        for it)."""
        if self._read_done is not None:
            self._read_done.record(torch.cuda.current_stream(self.raw.device))


class CudaGraphRunner:
    """Decode (and verify) steps as CUDA graphs, keyed by (number of tokens, uniform query length): the ladder
    of batch sizes for one-token steps, and for each verify length q = 1 + k in `query_lens` a ladder of its
    own (b sequences, b * q tokens, every row sampled). The attention backend says which one-token sizes get
    a second, one-split graph and up to which context (graph_variants)."""

    def __init__(self, model, kv_caches, max_num_seqs: int, max_model_len: int, block_size: int,
                 device: torch.device, last_sampled: torch.Tensor, query_lens=(1,),
                 state_padding_slot: Optional[int] = None, max_verify_rows: Optional[int] = None) -> None:
        """state_padding_slot: for models with linear-attention layers, the state pools' spare slot that padding
        rows write to (None: no such layers). max_verify_rows: the largest verify graph (rows), where the linear
        layers' static scratch holds no more (a ladder size; larger verify steps run eagerly)."""
        self.model = model
        # Layers that roll back rejected drafts from per-token states a verify step writes (GatedDeltaNet): found at
        # the first verify step.
        self._verify_layers: Optional[list] = None
        self.last_sampled = last_sampled
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.query_lens = sorted(set(query_lens) | {1})
        # Verify steps: up to MAX_VERIFY_TOKENS tokens a graph (larger ones take the eager / mixed path).
        verify_rows = min(max_num_seqs, max_verify_rows or max_num_seqs)
        self.sizes_by_q = {q: capture_sizes(max_num_seqs if q == 1 else min(verify_rows, MAX_VERIFY_TOKENS // q))
                           for q in self.query_lens}
        self.sizes = self.sizes_by_q[1]
        self.inputs_by_q = {q: DecodeInputs(sizes[-1], self.max_blocks_per_seq, device, q, state_padding_slot)
                            for q, sizes in self.sizes_by_q.items()}
        self.inputs = self.inputs_by_q[1]
        # {(tokens, q): graph} and its output, the hidden states [tokens, hidden].
        self.graphs: Dict[tuple, torch.cuda.CUDAGraph] = {}
        self.outputs: Dict[tuple, torch.Tensor] = {}
        # The one-split ladder of one-token steps: the context (tokens) up to which each size replays it.
        k_cache = first_attention_cache(kv_caches) if kv_caches else None
        self.short_limits: Dict[int, int] = {}
        if k_cache is not None:
            self.short_limits = get_backend(device).graph_variants(
                self.sizes, k_cache.shape[2], k_cache.element_size(), max_model_len, device)
        self.short_sizes = sorted(self.short_limits)
        self.short_graphs: Dict[int, torch.cuda.CUDAGraph] = {}
        self.short_outputs: Dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0
        self.pool = None  # the graphs' shared memory pool once captured (a draft's graphs join it)
        self.pdl_choice: dict = {}  # batch-1 replay times with / without PDL and the choice (capture_ladder)

    def views(self, b: int, short: bool = False, q: int = 1) -> ForwardBatch:
        """The static inputs of b sequences of q tokens; short: as the one-split graphs see them."""
        fb = self.inputs_by_q[q].views(b)
        return get_backend(fb.input_ids.device).capture_metadata(fb, "one_split" if short else "main")

    def prepare(self, b: int, short: bool = False, q: int = 1):
        """(ForwardBatch over the static inputs of size b, the step a graph of that size captures)."""
        fb, src = self.views(b, short, q), self.inputs_by_q[q].src(b)
        return fb, lambda: self._forward(fb, src)

    def capture(self) -> None:
        k_cache = first_attention_cache(self.kv_caches)
        num_blocks = k_cache.shape[0] if k_cache is not None else 0

        def at_context(ctx):  # only before any request exists: it writes into cache blocks 0..
            return self.inputs.set_context(1, ctx, self.block_size, num_blocks)

        graphs, outputs, self.capture_seconds = capture_ladder(self.sizes, self.kv_caches, self.prepare,
                                                               self.pdl_choice, at_context)
        self._keep(graphs, outputs, 1)
        pool = self.pool = graphs[self.sizes[-1]].pool()
        for q in self.query_lens[1:]:
            graphs, outputs, secs = capture_ladder(self.sizes_by_q[q], self.kv_caches,
                                                   lambda b, q=q: self.prepare(b, q=q), pool=pool)
            self._keep(graphs, outputs, q)
            self.capture_seconds += secs
        if self.short_sizes:
            self.short_graphs, self.short_outputs, secs = capture_ladder(
                self.short_sizes, self.kv_caches, lambda b: self.prepare(b, short=True),
                pool=pool, batch1_pdl=self.pdl_choice.get("batch1_pdl"))
            self.capture_seconds += secs

    def _keep(self, graphs, outputs, q: int) -> None:
        for b, g in graphs.items():
            self.graphs[(b * q, q)] = g
            self.outputs[(b * q, q)] = outputs[b]

    def _forward(self, fb: ForwardBatch, src: torch.Tensor):
        """-> hidden states [b * q, hidden]; with (hidden, aux hidden states [b * q, 3 * hidden]) when the model
        captures aux hidden states for an EAGLE-3 draft (each graph keeps its own aux output)."""
        # Tokens still on the device are read from the last step's samples inside the graph, by the
        # embedding lookup itself (kernels/embedding.py: one launch).
        hidden = self.model(fb.input_ids, fb.positions, src, self.last_sampled)
        inner = getattr(self.model, "model", None)
        if getattr(inner, "aux_hidden_layers", ()):
            return hidden, inner.aux_hidden
        return hidden

    def query_len_of(self, sched_reqs) -> int:
        """The step's uniform query length if a ladder has it (every row 1 token, or every row a verify row
        of the same 1 + k, all sampled), else 0."""
        q = sched_reqs[0].num_new_tokens if sched_reqs else 0
        if q not in self.sizes_by_q:
            return 0
        for sr in sched_reqs:
            if sr.num_new_tokens != q or (q > 1 and (not sr.sample or len(sr.spec_token_ids) != q - 1)):
                return 0
        return q

    def can_run(self, sched_reqs) -> bool:
        q = self.query_len_of(sched_reqs)
        return q > 0 and len(sched_reqs) <= self.sizes_by_q[q][-1]

    def uses_short_graph(self, sched_reqs, b: int) -> bool:
        """Whether the padded size b has a one-split graph and every context fits its limit."""
        return max(sr.start for sr in sched_reqs) < self.short_limits.get(b, 0)

    def run(self, sched_reqs, last_rows=None) -> torch.Tensor:
        """Replay the step of `sched_reqs`; returns a view of the first n * q rows of the hidden states,
        [n * q, hidden]. On a CPU (tests) the same padded step runs eagerly, which checks the static inputs
        and the in-graph token gather against the eager path."""
        n, q = len(sched_reqs), self.query_len_of(sched_reqs)
        b = padded_size(self.sizes_by_q[q], n)
        short = q == 1 and self.uses_short_graph(sched_reqs, b)  # a context is sr.start + 1 tokens
        inputs = self.inputs_by_q[q]
        inputs.fill(sched_reqs, b, self.block_size, last_rows)
        if inputs.raw.device.type != "cuda":
            fb = self.views(b, short, q)
            with forward_context(fb, self.kv_caches):
                out = self._forward(fb, inputs.src(b))
        else:
            if short:
                self.short_graphs[b].replay()
                out = self.short_outputs[b]
            else:
                self.graphs[(b * q, q)].replay()
                out = self.outputs[(b * q, q)]
            inputs.replayed()
        if q > 1:
            # A replay runs the layers' kernels, not their Python: a linear-attention layer's rollback source (set
            # by its forward during capture, and reset by every eager step since) must be pointed at the scratch
            # the graph wrote.
            if self._verify_layers is None:
                self._verify_layers = [m for m in self.model.modules()
                                       if callable(getattr(m, "replayed_verify", None))]
            for m in self._verify_layers:
                m.replayed_verify()
        return self._rows(out, n * q)

    def _rows(self, out, n: int) -> torch.Tensor:
        """The first n rows of a step's hidden states; its aux hidden states (a tuple output), sliced the same,
        go where the eager path leaves them: the model's aux_hidden (valid until the next step)."""
        if isinstance(out, tuple):
            self.model.model.aux_hidden = out[1][:n]
            out = out[0]
        return out[:n]
