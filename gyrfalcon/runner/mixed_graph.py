"""CUDA graphs for the steps that are not pure decode: prefills and chunked prefills (mixed with decode
tokens) of up to a few hundred tokens.

Eagerly, such a step launches every layer's kernels from Python: on a slow host (~24 us per launch,
more for a Triton launch) a 128-token prefill of a 32-layer model spends far longer launching than
computing, and that time is the whole of TTFT at batch 1. Here a step of n tokens from m sequences
replays the graph captured for the smallest ladder size t >= n (16, 32, 64, ... tokens) with room for
b = min(t, MAX_SEQS) sequences: the tokens past n are padding (slot -1: no KV write, position 0, in no
sequence), the sequences past m are empty (query length 0, seq_len 0), and the attention kernels size
their grids from these static shapes (paged_attention needs no host-side lengths). The graph ends with
the gather of the sampled rows, so it returns [b, hidden] and the LM head runs on those rows only.

Captured on a GPU unless enforce_eager: it cuts batch-1 TTFT of a 128-token prompt several-fold (measured on
the H200; docs/performance.md). On a CPU (tests) `run` executes the same padded forward eagerly, which checks
the padding semantics against the unpadded path.
"""

from __future__ import annotations

import bisect
from typing import Dict, List, Optional

import torch

from gyrfalcon.forward_context import forward_context
from gyrfalcon.runner.cuda_graph import capture_ladder
from gyrfalcon.runner.forward_batch import ForwardBatch, HostBatch

MAX_SEQS = 32  # sequences per captured graph of the ladder; a step with more runs eagerly
MAX_TOKENS = 512  # the top of the token ladder


def token_sizes(max_num_batched_tokens: int, top: int = MAX_TOKENS) -> List[int]:
    """16, 32, 64, ... up to min(top, max_num_batched_tokens) rounded up to the ladder."""
    limit = min(top, max(16, max_num_batched_tokens))
    sizes, t = [], 16
    while True:
        sizes.append(t)
        if t >= limit:
            return sizes
        t *= 2


class MixedInputs:
    """Static device buffers for up to T tokens of up to B sequences, with double-buffered pinned staging.

    int64 part: [input_ids T | positions T | slot_mapping T | src T | logits_indices B]
    (src[j] >= 0: token j is still on the device, at last_sampled[src[j]])
    int32 part: [query_start_loc B+1 | seq_lens B | block_tables B*W], packed two per int64 word after
    the int64 part, so a step's inputs go over in one copy (block-table rows past the batch's are not
    sent: empty sequences never read them).
    """

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: torch.device) -> None:
        T, B, W = max_tokens, max_seqs, max_blocks_per_seq
        self.T, self.B, self.W = T, B, W
        self.n64, self.n32 = 4 * T + B, (B + 1) + B + B * W
        words = self.n64 + -(-self.n32 // 2)
        self.raw = torch.zeros(words, dtype=torch.int64, device=device)
        self.i64, self.i32 = self._split(self.raw)
        self.i64[2 * T:4 * T] = -1  # slots and sources: nothing to write or read until filled
        pin = device.type == "cuda"
        self._staging = []
        for _ in range(2):
            h = torch.zeros(words, dtype=torch.int64, pin_memory=pin)
            h64, h32 = self._split(h)
            h64[2 * T:4 * T] = -1
            self._staging.append((h, h64.numpy(), h32.numpy()))
        self._turn = 0

    def _split(self, raw: torch.Tensor):
        return raw[:self.n64], raw[self.n64:].view(torch.int32)[:self.n32]

    def views(self, t: int, b: int):
        """(ForwardBatch, src, logits_indices) over the first t tokens and b sequences: what a graph captures."""
        T, B, W = self.T, self.B, self.W
        i64, i32 = self.i64, self.i32
        fb = ForwardBatch(
            input_ids=i64[:t], positions=i64[T:T + t], slot_mapping=i64[2 * T:2 * T + t],
            query_start_loc=i32[:b + 1], seq_lens=i32[B + 1:B + 1 + b],
            block_tables=i32[2 * B + 1:].view(B, W)[:b], logits_indices=i64[4 * T:4 * T + b],
            is_decode=False, max_query_len=t, max_seq_len=W, num_seqs=b)
        return fb, i64[3 * T:3 * T + t], i64[4 * T:4 * T + b]

    def fill(self, hb: HostBatch, t: int, b: int) -> None:
        """Write `hb` padded to t tokens and b sequences into the staging buffer and send it."""
        T, B, W = self.T, self.B, self.W
        n, m, w = hb.num_tokens, hb.num_seqs, hb.block_tables.shape[1]
        assert n <= t <= T and m <= b <= B and w <= W, (n, t, m, b, w)
        self._turn ^= 1
        host, n64, n32 = self._staging[self._turn]
        n64[:n] = hb.input_ids
        n64[n:t] = 0
        n64[T:T + n] = hb.positions
        n64[T + n:T + t] = 0
        n64[2 * T:2 * T + n] = hb.slot_mapping
        n64[2 * T + n:2 * T + t] = -1
        src = n64[3 * T:3 * T + t]
        src[:] = -1
        if hb.pending_rows:
            src[hb.pending_rows] = hb.pending_src
        S = len(hb.sample_rows)
        n64[4 * T:4 * T + S] = hb.sample_rows
        n64[4 * T + S:4 * T + b] = 0  # padding rows gather row 0: computed, never read
        n32[:m + 1] = hb.query_start_loc
        n32[m + 1:b + 1] = n  # empty sequences after the last real one
        n32[B + 1:B + 1 + m] = hb.seq_lens
        n32[B + 1 + m:B + 1 + b] = 0
        bt = n32[2 * B + 1:].reshape(B, W)
        bt[:m, :w] = hb.block_tables
        words = self.n64 + -(-(2 * B + 1 + m * W) // 2)
        self.raw[:words].copy_(host[:words], non_blocking=True)


class MixedGraphRunner:
    def __init__(self, model, kv_caches, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                 block_size: int, device: torch.device, last_sampled: torch.Tensor) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.last_sampled = last_sampled
        self.block_size = block_size
        self.device = device
        self.sizes = token_sizes(max_num_batched_tokens, MAX_TOKENS)
        self.max_seqs = min(MAX_SEQS, max_num_seqs)
        seqs = max(self.seqs_for(t) for t in self.sizes)
        self.inputs = MixedInputs(self.sizes[-1], seqs, -(-max_model_len // block_size), device)
        self.graphs: Dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: Dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0

    def seqs_for(self, t: int) -> int:
        """Sequences the graph of t tokens has room for."""
        return min(t, self.max_seqs)

    def prepare(self, t: int):
        """(ForwardBatch over the static inputs of t tokens, every sequence empty as during capture, the step a
        graph of that size captures)."""
        fb, src, li = self.inputs.views(t, self.seqs_for(t))
        return fb, lambda: self._forward(fb, src, li)

    def capture(self) -> None:
        self.graphs, self.outputs, self.capture_seconds = capture_ladder(self.sizes, self.kv_caches, self.prepare)

    def _forward(self, fb: ForwardBatch, src: torch.Tensor, li: torch.Tensor):
        """-> hidden states of the sampled rows, [b, hidden] (rows past the batch's samples: padding); with (that,
        aux hidden states of every token [t, n_aux * hidden]) when the model keeps them for a draft (EAGLE-3 reads
        every prompt position's, MTP the last layer's): each graph keeps its own aux output."""
        # Tokens still on the device come from last_sampled inside the embedding lookup (one launch).
        hidden = self.model(fb.input_ids, fb.positions, src, self.last_sampled)
        inner = getattr(self.model, "model", None)
        if getattr(inner, "aux_hidden_layers", ()):
            return hidden[li], inner.aux_hidden
        return hidden[li]

    def size_for(self, num_tokens: int, num_seqs: int) -> Optional[int]:
        """The graph a step of these counts replays (None: it runs eagerly): the smallest ladder size that
        holds it."""
        n = max(num_tokens, 1)
        for t in self.sizes[bisect.bisect_left(self.sizes, n):]:
            if num_seqs <= self.seqs_for(t):
                return t
        return None

    def can_run(self, rows) -> bool:
        """rows: ScheduledRequest (RequestState attached). A graph of b sequences gathers b sampled rows: a verify step's 1 + k
        samples per sequence count against that too."""
        seqs = max(len(rows), sum(r.num_sampled_rows for r in rows))
        return self.size_for(sum(r.num_new_tokens for r in rows), seqs) is not None

    def run(self, hb: HostBatch) -> torch.Tensor:
        """Replay (on a CPU: run eagerly) the padded step; returns the sampled rows' hidden states
        [S, hidden] (a view). Aux hidden states, where the model keeps them, go where the eager path leaves them:
        the model's aux_hidden, the step's T real rows (valid until the next step)."""
        t = self.size_for(hb.num_tokens, max(hb.num_seqs, len(hb.sample_rows)))
        b = self.seqs_for(t)
        self.inputs.fill(hb, t, b)
        S = len(hb.sample_rows)
        if self.device.type != "cuda":
            fb, src, li = self.inputs.views(t, b)
            with forward_context(fb, self.kv_caches):
                out = self._forward(fb, src, li)
        else:
            self.graphs[t].replay()
            out = self.outputs[t]
        if isinstance(out, tuple):
            self.model.model.aux_hidden = out[1][:hb.num_tokens]
            out = out[0]
        return out[:S]
