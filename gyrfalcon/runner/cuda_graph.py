"""CUDA graphs for decode steps: the whole model forward (attention included) replayed as one graph.

The GPU host is slow (~24 us per eager launch), and a decode step of a small model launches
hundreds of kernels; replaying a captured graph costs one launch. Graphs are captured once per
batch size of a ladder (1, 2, 4, 8, 16, 24, ... up to max_num_seqs); a batch of n sequences
replays the smallest captured size >= n, the extra rows padded so they do nothing: slot -1 (the
KV store skips it) and seq_len 0 (decode attention writes zeros without reading the cache).

Every graph reads its inputs from one set of static device buffers. The host fills a pinned
staging copy of them and sends them in one copy, so preparing a step costs a handful of launches
whatever the batch size.

With with_logits (GYRFALCON_GRAPH_LOGITS=1; off: on the H200 it was no faster, 0.879 vs 0.881 ms per
Qwen3-0.6B batch-1 step, benchmarks/results/*-h200-2026-11-30-run5.json, and 0.747 vs 0.750 in run 16)
the graph also holds the LM head, the greedy argmax and the write of those tokens into last_sampled, so
a greedy step is one replay and one copy back; the runner uses the logits for any other sampling, and its sampler's
tokens then overwrite last_sampled after the replay.

The small sizes (up to SHORT_GRAPH_MAX_BATCH) get a second graph whose decode attention runs one split per
sequence: no split merge, so one launch per layer fewer. A batch whose contexts all fit in
GYRFALCON_SHORT_GRAPH_CONTEXT tokens (default 128: short_graph_context) replays it; the main graph's splits
(sized for the block table's full width, max_model_len) then mostly hold no keys, but the reduce launch
runs anyway. The sizes whose one-split attention takes the one-stage 256-key tile (batch 5-16 at 8 kv heads:
paged_decode_attention.wide_tile_context) get one as well, replayed up to 256 tokens of context. With
GYRFALCON_B1_MERGED_SPLITS=S (merged_graph_splits) batch 1's second graph is the merged one instead: S splits
of up to MERGED_SPLIT_TOKENS keys (one prefetched tile each) whose partials o_proj merges while loading its
input (small_m_gemv.merged_heads_gemv), also without the reduce launch, for contexts of up to
S * MERGED_SPLIT_TOKENS tokens.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import os
import time
from typing import Callable, Dict, List, Optional

import numpy as np
import torch

from gyrfalcon.forward_context import forward_context
from gyrfalcon.kernels._common import pdl_disabled, pdl_mode, pdl_possible, pdl_warmup
from gyrfalcon.kernels.argmax import greedy_argmax
from gyrfalcon.kernels.paged_decode_attention import wide_tile_context
from gyrfalcon.runner.forward_batch import ForwardBatch
from gyrfalcon.runner.precompile import ladder_warmup_steps, parallel_compile_enabled, precompile

logger = logging.getLogger(__name__)


def side_stream_copies() -> bool:
    """GYRFALCON_SIDE_STREAM_COPIES (on by default; 0 turns it off): a decode step's input copy to the device
    (DecodeInputs.fill) and its sampled tokens' copy back (ModelRunner.launch) run on side streams, ordered by
    events, instead of in the compute stream between the kernels. In the stream, each sits between one step's
    kernels and the next: the input copy (the row-major block table, batch x max_model_len / 16 entries: 2 MB a
    step at Llama-3.1-8B batch 64, 12.6 MB at 384 sequences) after the last step's argmax, the token copy after
    its own. On the side the input copy waits only for the last replay to finish reading the inputs, and runs
    under the LM head and argmax.
    H200, run 69, same call ABAB: Qwen3-0.6B batch 1 0.702 / 0.701 vs 0.718 / 0.718 ms a step, Llama-3.1-8B batch
    64 5.166 / 5.168 vs 5.229 / 5.222 ms; the throughput row tied (run 70: 9,819 vs 9,778 tok/s)."""
    return os.environ.get("GYRFALCON_SIDE_STREAM_COPIES", "1") != "0"


def graph_logits_enabled() -> bool:
    return os.environ.get("GYRFALCON_GRAPH_LOGITS", "0") == "1"


MAX_CAPTURE_SIZE = 512  # larger decode batches run eagerly: their launches are small next to the GPU's work
# Sizes that get a one-split graph too. On the H200 (benchmarks/results/latency_*_short256-h200-2026-11-30-run24.json,
# replays at 128 tokens of context) it won at batch 1 and 4 (Qwen3-0.6B b1 0.617 vs 0.645 ms, b4 1.101 vs
# 1.171; Llama-3.1-8B b1 3.854 vs 3.939) and lost at batch 16 (Llama 4.326 vs 4.292).
SHORT_GRAPH_MAX_BATCH = 4
# Default tokens of context. At 256 the one-split step lost: Qwen b1 0.717 vs 0.648 ms (run 24); with one 256-key tile
# loaded whole before the PDL wait, 0.813 ms a step at 16 warps and 0.751 at 8 vs 0.722 (latency_qwen3-0.6b_b1_short_*-
# h200-2026-12-01-run60.json; the split graph's attention at 16 warps: 0.745).
SHORT_GRAPH_CONTEXT = 128


def short_graph_context() -> int:
    """GYRFALCON_SHORT_GRAPH_CONTEXT: tokens of context up to which decode batches of at most
    SHORT_GRAPH_MAX_BATCH sequences replay the one-split graph (default SHORT_GRAPH_CONTEXT; 0: no such
    graphs). The main graph launches the split kernel for the block table's full width (a graph must not
    depend on the actual lengths) and a reduce launch per layer; within one 128-key tile the one-split
    launch does the same work in one launch. Past it, one program per (sequence, kv head) walks every
    tile alone, where the main graph spreads the tiles over splits: slower from 256 tokens."""
    return max(0, int(os.environ.get("GYRFALCON_SHORT_GRAPH_CONTEXT", str(SHORT_GRAPH_CONTEXT))))


MERGED_SPLIT_TOKENS = 128  # keys a split of the merged batch-1 graph holds: one tile of the batch-1 launch


def merged_graph_splits() -> int:
    """GYRFALCON_B1_MERGED_SPLITS=S (default 0: off): batch 1's second graph splits decode attention S ways
    (S = 1, 2 or 4) and merges the splits inside o_proj, for contexts of up to S * MERGED_SPLIT_TOKENS tokens.
    Where the one-split graph walks two tiles in one program from 129 tokens (slower than the main graph, run
    24), each split here holds one tile, loaded before the PDL wait; the reduce launch goes as in the one-split
    graph. Off: it lost on the H200 (latency_*_b1_merged_*-h200-2026-12-01-run61.json, 128-token prompts, 128
    new tokens): Qwen3-0.6B 0.770 / 0.769 ms a step with 2 splits and 0.821 / 0.818 with 4, against 0.725 / 0.723
    without; its graph replayed in 0.673 ms at 128 tokens against the main graph's 0.632 and the one-split
    graph's 0.607, though at 0 tokens (nothing to merge) in 0.451 against 0.503; Llama-3.1-8B (no PDL there)
    4.391 against 4.187 ms. GPU tests of the path pass (tests/gpu: the kernels at 2 / 4 splits, the model's
    tokens in fp32 and bf16)."""
    s = int(os.environ.get("GYRFALCON_B1_MERGED_SPLITS", "0"))
    if s not in (0, 1, 2, 4):
        raise ValueError(f"GYRFALCON_B1_MERGED_SPLITS must be 0, 1, 2 or 4, not {s}")
    return s


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
        with torch.cuda.graph(g, pool=pool):
            out = step()
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
    use_pdl). Whether that pays depends on the model (H200: 0.729 vs 0.802 ms per Qwen3-0.6B step, but
    4.289 vs 3.971 ms per Llama-3.1-8B step), so with GYRFALCON_PDL unset ("auto") the batch-1 graph is
    captured both ways, timed, and the faster kept; `report` (if given) receives the two times and the
    choice. at_context(ctx) (if given) points the batch-1 static inputs at one token at that context
    (False: it does not fit), so that the timing includes decode attention's work, which the prefetch
    changes with PDL (at seq_len 0, as captured, attention reads nothing); at_context(0) restores them.
    pool: a memory pool to share (another ladder's). batch1_pdl True / False: capture batch 1 that way,
    untimed (a second ladder follows the first one's choice)."""
    t0 = time.perf_counter()
    graphs: Dict[int, torch.cuda.CUDAGraph] = {}
    outputs: Dict[int, object] = {}
    if parallel_compile_enabled():  # (runner/precompile.py)
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
            keep_pdl = ms_pdl < ms_off
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
    """Static buffers of a decode step for up to B sequences, plus their pinned host staging.

    int64 part: [input_ids B | positions B | slot_mapping B | src B]
    (src[i] >= 0: row i's token is still on the device, at last_sampled[src[i]])
    int32 part: [seq_lens B | query_start_loc B+1 | block_tables W*B]   (W = max blocks per seq)
    Both parts are views of one buffer, so a step's inputs go to the device in one copy.

    The block table is row-major ([b, W], strides (W, 1)) and a step sends all b * W entries; W follows
    max_model_len (8,192 blocks for Llama-3.1-8B's 131,072 tokens: 12.6 MB per decode step at 384 sequences).
    GYRFALCON_DECODE_BT_COLUMNS=1 makes it column-major (block j of sequence i at j * B + i; the graphs see a
    [b, W] view with strides (1, B)), so the blocks a step uses, the first w of every sequence, are one
    contiguous prefix of w * B entries and a step sends only that (~0.2 MB at 2,048 tokens of context). It
    measured slower on the H200 (run 41, gpu_check.sh btcolumns, Llama-3.1-8B): 18.40 / 18.65 ms per decode
    step against 18.03 / 18.17 row-major at 384 sequences of 512-576 tokens (ABBA), 5.44 against 5.40 ms at
    64: the attention kernel's strided reads of the block ids cost more than the copy saves, so it stays off.
    """

    def __init__(self, max_batch: int, max_blocks_per_seq: int, device: torch.device) -> None:
        B, W = max_batch, max_blocks_per_seq
        self.B, self.W = B, W
        self.columns = os.environ.get("GYRFALCON_DECODE_BT_COLUMNS", "0") == "1"
        n32 = B + (B + 1) + B * W
        self._words = 4 * B + -(-n32 // 2)  # int64 words: the int32 part packed two per word
        self.raw = torch.zeros(self._words, dtype=torch.int64, device=device)
        self.i64, self.i32 = self._split(self.raw, n32)
        # No row's token is pending until a step says so: the captures' warm-up steps (and the parallel
        # compile's, whose Triton outputs are never written) then embed input_ids (zeros) instead of
        # last_sampled[0], which holds whatever the last step left there. With the LM head and argmax in
        # the graph (GYRFALCON_GRAPH_LOGITS=1) a compile-only warm-up copied its argmax's uninitialized
        # output into last_sampled, and the next warm-up embedded that garbage token id: an illegal
        # memory access at startup (H200, run 43).
        self.src(B).fill_(-1)
        pin = device.type == "cuda"
        # Two staging copies, alternated: with async scheduling the host fills step N+1 while step N's
        # non-blocking copy out of the other one may not have run yet.
        self._staging = []
        for _ in range(2):
            hraw = torch.zeros(self._words, dtype=torch.int64, pin_memory=pin)
            h64, h32 = self._split(hraw, n32)
            h32.numpy()[B:2 * B + 1] = np.arange(B + 1)  # one query per sequence, forever
            self._staging.append((hraw, h64.numpy(), h32.numpy()))
        self._turn = 0
        # side_stream_copies: the copy runs on its own stream once the last replay is done reading the buffers
        # (replayed() marks that), and the compute stream waits for it before the next replay.
        self._copy_stream = self._read_done = self._copied = None
        if pin and side_stream_copies():
            self._copy_stream = torch.cuda.Stream(device)
            self._read_done, self._copied = torch.cuda.Event(), torch.cuda.Event()

    def _split(self, raw: torch.Tensor, n32: int):
        return raw[:4 * self.B], raw[4 * self.B:].view(torch.int32)[:n32]

    def views(self, b: int) -> ForwardBatch:
        """A ForwardBatch over the first b rows of the device buffers (what a graph captures)."""
        B, W = self.B, self.W
        table = self.i32[2 * B + 1:]
        table = table.view(W, B).t() if self.columns else table.view(B, W)
        return ForwardBatch(
            input_ids=self.i64[:b], positions=self.i64[B:B + b], slot_mapping=self.i64[2 * B:2 * B + b],
            seq_lens=self.i32[:b], query_start_loc=self.i32[B:B + b + 1], block_tables=table[:b],
            logits_indices=torch.arange(b, device=self.i64.device), is_decode=True,
            max_query_len=1, max_seq_len=W, num_seqs=b)

    def src(self, b: int) -> torch.Tensor:
        return self.i64[3 * self.B:3 * self.B + b]

    def set_context(self, b: int, ctx: int, block_size: int, num_blocks: Optional[int] = None) -> bool:
        """Point the first b rows of the device buffers at one decode token each at context ctx (row i
        uses cache blocks i * nb .. (i + 1) * nb - 1, token id 0), for timing a graph where attention
        has work (seq_len 0, what the capture leaves, reads nothing); ctx 0 restores that empty state.
        A replay then writes one K/V slot per row into those blocks: only while no request holds them.
        False (nothing written) when ctx does not fit the block-table width or the cache's num_blocks."""
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
        """Write the decode inputs of `sched_reqs` (padded to b rows) and send them; returns n.
        A token the host does not have yet is marked by its row in the last step's samples."""
        B, W = self.B, self.W
        n = len(sched_reqs)
        self._turn ^= 1
        hraw, n64, n32 = self._staging[self._turn]
        # Row-major: bt[i, j] is block j of row i (column-major with GYRFALCON_DECODE_BT_COLUMNS=1: bt[j, i]).
        bt = n32[2 * B + 1:].reshape(W, B) if self.columns else n32[2 * B + 1:].reshape(B, W).T
        w = 1
        for i, sr in enumerate(sched_reqs):
            req = sr.request
            pos = sr.start
            if pos < req.num_tokens:
                n64[i] = req.token_id_at(pos)
                n64[3 * B + i] = -1
            else:
                n64[i] = 0
                n64[3 * B + i] = last_rows[req.request_id]
            n64[B + i] = pos
            blocks = req.block_ids
            n64[2 * B + i] = blocks[pos // block_size] * block_size + pos % block_size
            n32[i] = pos + 1
            bt[:len(blocks), i] = blocks
            w = max(w, len(blocks))
        n64[n:b] = 0
        n64[B + n:B + b] = 0
        n64[2 * B + n:2 * B + b] = -1
        n64[3 * B + n:3 * B + b] = -1
        n32[n:b] = 0
        # One copy, up to the last block-table column in use: entries past a row's own blocks, or in rows past n,
        # are never read (seq_lens bounds every read; padding rows have seq_len 0).
        words = 4 * B + -(-(2 * B + 1 + (w * B if self.columns else b * W)) // 2)
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
        """Mark, on the current stream, the end of a replay that reads these buffers (side_stream_copies)."""
        if self._read_done is not None:
            self._read_done.record(torch.cuda.current_stream(self.raw.device))


class CudaGraphRunner:
    def __init__(self, model, kv_caches, max_num_seqs: int, max_model_len: int, block_size: int,
                 device: torch.device, last_sampled: torch.Tensor, with_logits: bool = False) -> None:
        self.model = model
        self.last_sampled = last_sampled
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.with_logits = with_logits
        self.sizes = capture_sizes(max_num_seqs)
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.inputs = DecodeInputs(self.sizes[-1], self.max_blocks_per_seq, device)
        self.graphs: Dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: Dict[int, tuple] = {}
        # The one-split ladder (short_graph_context; batch 1: the merged graph, merged_graph_splits): its sizes,
        # the context (tokens) up to which each size replays it, and their graphs once captured.
        short = short_graph_context()
        self.short_context = short if 0 < short < max_model_len else 0
        self.short_limits = {s: self.short_context for s in self.sizes
                             if s <= SHORT_GRAPH_MAX_BATCH and self.short_context}
        # Sizes whose one-split launch takes the wide tile (wide_tile_context: batch 5-16 at 8 kv heads on a bf16
        # cache) get a one-split graph too, for contexts within that one tile.
        if kv_caches:
            k_cache = kv_caches[0][0]
            for s in self.sizes:
                wide = wide_tile_context(s * k_cache.shape[2], k_cache.element_size(), device)
                if s not in self.short_limits and 0 < wide < max_model_len:
                    self.short_limits[s] = wide
        merged = merged_graph_splits()
        self.merged_splits = merged if 0 < merged * MERGED_SPLIT_TOKENS < max_model_len and 1 in self.sizes else 0
        if self.merged_splits:
            self.short_limits[1] = self.merged_splits * MERGED_SPLIT_TOKENS
        self.short_sizes = sorted(self.short_limits)
        self.short_graphs: Dict[int, torch.cuda.CUDAGraph] = {}
        self.short_outputs: Dict[int, tuple] = {}
        self.capture_seconds = 0.0
        self.pdl_choice: dict = {}  # batch-1 replay times with / without PDL and the choice (capture_ladder)

    def views(self, b: int, short: bool = False) -> ForwardBatch:
        """The static inputs of size b; short: as the one-split (batch 1: maybe the merged) graphs see them."""
        fb = self.inputs.views(b)
        if short and b == 1 and self.merged_splits:
            return dataclasses.replace(fb, decode_num_splits=self.merged_splits, decode_merge_o_proj=True)
        return dataclasses.replace(fb, decode_num_splits=1) if short else fb

    def prepare(self, b: int, short: bool = False):
        """(ForwardBatch over the static inputs of size b, the step a graph of that size captures)."""
        fb, src = self.views(b, short), self.inputs.src(b)
        return fb, lambda: self._forward(fb, src)

    def capture(self) -> None:
        prepare = self.prepare
        num_blocks = self.kv_caches[0][0].shape[0] if self.kv_caches else 0

        def at_context(ctx):  # only before any request exists: it writes into cache blocks 0..
            return self.inputs.set_context(1, ctx, self.block_size, num_blocks)

        self.graphs, self.outputs, self.capture_seconds = capture_ladder(self.sizes, self.kv_caches, prepare,
                                                                         self.pdl_choice, at_context)
        if self.short_sizes:
            self.short_graphs, self.short_outputs, secs = capture_ladder(
                self.short_sizes, self.kv_caches, lambda b: prepare(b, short=True),
                pool=self.graphs[self.sizes[-1]].pool(), batch1_pdl=self.pdl_choice.get("batch1_pdl"))
            self.capture_seconds += secs

    def _forward(self, fb: ForwardBatch, src: torch.Tensor) -> tuple:
        """-> (hidden [b, hidden], logits [b, vocab] fp32 or None, greedy tokens [b] or None)"""
        # Tokens still on the device are read from the last step's samples inside the graph, by the
        # embedding lookup itself (kernels/embedding.py: one launch).
        hidden = self.model(fb.input_ids, fb.positions, src, self.last_sampled)
        if not self.with_logits:
            return hidden, None, None
        logits = self.model.compute_logits(hidden)
        greedy = greedy_argmax(logits)
        self.last_sampled[:greedy.shape[0]].copy_(greedy)
        return hidden, logits, greedy

    def can_run(self, sched_reqs) -> bool:
        return (len(sched_reqs) <= self.sizes[-1]
                and all(sr.num_new_tokens == 1 for sr in sched_reqs))

    def uses_short_graph(self, sched_reqs, b: int) -> bool:
        """Whether the padded size b has a one-split (or merged) graph and every context fits its limit."""
        return max(sr.start for sr in sched_reqs) < self.short_limits.get(b, 0)

    def run(self, sched_reqs, last_rows=None) -> tuple:
        """Replay the decode step of `sched_reqs`; returns views of the first n rows of
        (hidden, logits or None, greedy tokens or None). On a CPU (tests) the same padded step runs
        eagerly, which checks the static inputs and the in-graph token gather against the eager path."""
        n = len(sched_reqs)
        b = padded_size(self.sizes, n)
        short = self.uses_short_graph(sched_reqs, b)  # a context is sr.start + 1 tokens
        self.inputs.fill(sched_reqs, b, self.block_size, last_rows)
        if self.inputs.raw.device.type != "cuda":
            fb = self.views(b, short)
            with forward_context(fb, self.kv_caches):
                out = self._forward(fb, self.inputs.src(b))
            return tuple(t[:n] if t is not None else None for t in out)
        graphs, outputs = (self.short_graphs, self.short_outputs) if short else (self.graphs, self.outputs)
        graphs[b].replay()
        self.inputs.replayed()
        return tuple(t[:n] if t is not None else None for t in outputs[b])
