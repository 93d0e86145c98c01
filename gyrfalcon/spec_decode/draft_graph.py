"""DraftGraphRunner: a draft proposer's passes (spec_decode/eagle3.py, mtp.py) replayed as CUDA graphs.

After each step the proposer runs a catch-up pass over the positions the step verified or prefilled, then k - 1
chained one-token passes. Eagerly each pass is a few launches per draft layer plus an argmax and an embedding
lookup, on a host measured at ~24 us per launch; a k = 4 chain is a few hundred microseconds of launches for a few
tens of microseconds of GPU work. So, over the decode graphs' batch-size ladder (b padded rows, runner/cuda_graph.py):

- one chain graph per b holds all k - 1 chained passes: pass s reads pass s - 1's hidden state and argmax on the
  device (embedding lookup of a device token) and returns the k drafts [b, k] (the first one is the catch-up's);
  the host reads them once;
- one catch-up graph per (b, q), where the step just run was a decode step (q = 1: every row one sampled token) or a
  verify step (q = 1 + k: every row all of its drafts): it runs the pass over the b * q positions, writes each row's
  last kept position's hidden state and argmax into the chain graph's inputs, and the chain graph follows. After a
  verify step a row kept 1 + n of its q positions: the other q - 1 - n (rejected drafts' positions) still run as
  queries (their outputs unused) but write no K/V (slot -1), exactly as the eager pass, which leaves them out.
  Prefill and mixed steps run the catch-up eagerly and then replay the chain graph.

Static inputs (one pinned host staging buffer, one copy per step; int64 then int32, the block table last so that a
step sends only the rows it uses):
  int64: ids [T] | pos [T] | slots [T] | last [B] | chain pos [(k - 1) * B] | chain slots [(k - 1) * B]
  int32: seq_lens [B] | query_start_loc [B + 1] | chain seq_lens [(k - 1) * B] | chain qsl [B + 1] | block table [B * W]
T = max(B, B_verify * (1 + k)); W covers max_model_len + k positions (the chain writes k - 1 past a sequence).
Padding rows (b - n of them) are those of the decode graphs: slot -1 (no K/V write), seq_len 0 (attention reads
nothing), no query in a verify-shaped catch-up. Device-only: aux [T, A] (the target's aux hidden states, copied in),
tok0 [B] and h0 [B, H] (the chain's inputs). The graphs share the runner's memory pool.

On a CPU (tests) the same closures run eagerly over the same static inputs, which checks the padding, the in-graph
gathers and the chained passes against the proposer's eager path.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from gyrfalcon.forward_context import forward_context
from gyrfalcon.layers.attention import get_backend
from gyrfalcon.runner.cuda_graph import MAX_VERIFY_TOKENS, capture_ladder, capture_sizes, padded_size
from gyrfalcon.runner.forward_batch import ForwardBatch


class DraftGraphRunner:
    def __init__(self, proposer, kv_caches, block_size: int, max_num_seqs: int, max_model_len: int,
                 device: torch.device, aux_width: int, hidden_size: int, dtype: torch.dtype) -> None:
        """proposer: an Eagle3Proposer (or MtpProposer): _forward(step, ids, hidden, positions) ->
        (fed-back hidden, normed), _tokens(step, normed) -> target ids, _combine(aux) -> the first pass's hidden."""
        self.prop = proposer
        self.k = k = proposer.k
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = torch.device(device)
        self.sizes = capture_sizes(max_num_seqs)
        self.q_lens = (1, 1 + k)
        self.sizes_by_q = {1: self.sizes, 1 + k: capture_sizes(min(max_num_seqs, max(1, MAX_VERIFY_TOKENS // (1 + k))))}
        B = self.B = self.sizes[-1]
        self.W = W = -(-(max_model_len + k) // block_size)
        self.T = T = max(B, self.sizes_by_q[1 + k][-1] * (1 + k))
        C = (k - 1) * B
        # Offsets of each section (int64 words; int32 entries of the int32 part).
        self._o64 = o = {}
        pos = 0
        for name, n in (("ids", T), ("pos", T), ("slots", T), ("last", B), ("cpos", C), ("cslots", C)):
            o[name] = (pos, n)
            pos += n
        self._n64 = pos
        self._o32 = o32 = {}
        pos = 0
        for name, n in (("seq", B), ("qsl", B + 1), ("cseq", C), ("cqsl", B + 1), ("bt", B * W)):
            o32[name] = (pos, n)
            pos += n
        self._n32 = pos
        words = self._n64 + -(-pos // 2)
        self.raw = torch.zeros(words, dtype=torch.int64, device=self.device)
        pin = self.device.type == "cuda"
        self._host = torch.zeros(words, dtype=torch.int64, pin_memory=pin)
        self.d64, self.d32 = self._split(self.raw)
        h64, h32 = self._split(self._host)
        self.h64, self.h32 = h64.numpy(), h32.numpy()
        # The chain's one query per sequence, forever (padding rows too: a decode step's layout).
        self.h32[o32["cqsl"][0]:o32["cqsl"][0] + B + 1] = np.arange(B + 1)
        self.h64[o["cslots"][0]:o["cslots"][0] + C] = -1
        self.h64[o["slots"][0]:o["slots"][0] + T] = -1
        self.raw.copy_(self._host)
        self.aux = torch.zeros(T, aux_width, dtype=dtype, device=self.device)
        self.tok0 = torch.zeros(B, dtype=torch.int64, device=self.device)
        self.h0 = torch.zeros(B, hidden_size, dtype=dtype, device=self.device)
        self.chain_graphs: Dict[int, torch.cuda.CUDAGraph] = {}
        self.chain_out: Dict[int, torch.Tensor] = {}
        self.catch_up_graphs: Dict[Tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.capture_seconds = 0.0

    def _split(self, raw: torch.Tensor):
        return raw[:self._n64], raw[self._n64:].view(torch.int32)[:self._n32]

    def _v64(self, name: str, a: int = 0, n: Optional[int] = None) -> torch.Tensor:
        s, size = self._o64[name]
        return self.d64[s + a:s + a + (size if n is None else n)]

    def _v32(self, name: str, a: int = 0, n: Optional[int] = None) -> torch.Tensor:
        s, size = self._o32[name]
        return self.d32[s + a:s + a + (size if n is None else n)]

    # ---- the batches the graphs capture ------------------------------------------------------------
    def _table(self, b: int) -> torch.Tensor:
        return self._v32("bt").view(self.B, self.W)[:b]

    def catch_up_batch(self, b: int, q: int) -> ForwardBatch:
        """The catch-up pass of b sequences of q positions each, over the static inputs."""
        fb = ForwardBatch(
            input_ids=self._v64("ids", 0, b * q), positions=self._v64("pos", 0, b * q),
            slot_mapping=self._v64("slots", 0, b * q), seq_lens=self._v32("seq", 0, b),
            query_start_loc=self._v32("qsl", 0, b + 1), block_tables=self._table(b),
            logits_indices=self._v64("last", 0, b), is_decode=q == 1, max_query_len=q, max_seq_len=self.W,
            num_seqs=b, uniform_query_len=q)
        return get_backend(self.device).capture_metadata(fb, "main")

    def chain_batch(self, b: int, s: int) -> ForwardBatch:
        """Chained pass s (1..k - 1) of b sequences: one token each at its last position + s."""
        a = (s - 1) * self.B
        fb = ForwardBatch(
            input_ids=self.tok0[:b], positions=self._v64("cpos", a, b), slot_mapping=self._v64("cslots", a, b),
            seq_lens=self._v32("cseq", a, b), query_start_loc=self._v32("cqsl", 0, b + 1),
            block_tables=self._table(b), logits_indices=self._v64("last", 0, b), is_decode=True, max_query_len=1,
            max_seq_len=self.W, num_seqs=b, uniform_query_len=1)
        return get_backend(self.device).capture_metadata(fb, "main")

    def prepare_catch_up(self, b: int, q: int):
        """(ForwardBatch, the step a catch-up graph captures): the pass over the b * q positions, then each row's
        last kept position's hidden state and draft into the chain's inputs h0 / tok0 -> tok0[:b]."""
        fb = self.catch_up_batch(b, q)
        prop = self.prop

        def step():
            with forward_context(fb, self.kv_caches):
                hidden, normed = prop._forward(0, fb.input_ids, prop._combine(self.aux[:b * q]), fb.positions)
            sel = fb.logits_indices
            self.h0[:b].copy_(hidden[sel])
            self.tok0[:b].copy_(prop._tokens(0, normed[sel]))
            return self.tok0[:b]
        return fb, step

    def prepare_chain(self, b: int):
        """(ForwardBatch, the step a chain graph captures): k - 1 chained passes from tok0 / h0 -> the k drafts
        [b, k] (target ids)."""
        fbs = [self.chain_batch(b, s) for s in range(1, self.k)]
        prop = self.prop

        def step():
            tok, h = self.tok0[:b], self.h0[:b]
            drafts = [tok]
            for s, fb in enumerate(fbs, start=1):
                with forward_context(fb, self.kv_caches):
                    h, normed = prop._forward(s, tok, h, fb.positions)
                tok = prop._tokens(s, normed)
                drafts.append(tok)
            return torch.stack(drafts, dim=1)
        return fbs[0], step

    def capture(self, pool=None, batch1_pdl: Optional[bool] = None) -> None:
        """Capture the chain ladder, then a catch-up ladder per q, in `pool` (the decode graphs')."""
        if self.k > 1:
            graphs, outs, secs = capture_ladder(self.sizes, self.kv_caches, self.prepare_chain, pool=pool,
                                                batch1_pdl=batch1_pdl)
            self.chain_graphs, self.chain_out = graphs, outs
            self.capture_seconds += secs
            pool = graphs[self.sizes[-1]].pool()
        for q in self.q_lens:
            graphs, _, secs = capture_ladder(self.sizes_by_q[q], self.kv_caches,
                                             lambda b, q=q: self.prepare_catch_up(b, q), pool=pool,
                                             batch1_pdl=batch1_pdl)
            pool = graphs[self.sizes_by_q[q][-1]].pool()
            self.catch_up_graphs.update({(b, q): g for b, g in graphs.items()})
            self.capture_seconds += secs

    # ---- one step ------------------------------------------------------------------------------------
    def catch_up_len(self, rows, sampled, n_tokens: int) -> int:
        """q when the step's rows make a captured catch-up shape (every row a sampled decode token, or every row a
        verify row of 1 + k with its tokens back; n within the ladder), else 0 (the catch-up runs eagerly)."""
        if not rows:
            return 0
        q = rows[0].num_new_tokens
        if q not in self.sizes_by_q or len(rows) > self.sizes_by_q[q][-1] or n_tokens != len(rows) * q:
            return 0
        for r, toks in zip(rows, sampled):
            if r.num_new_tokens != q or not r.sample or not toks or len(r.spec_token_ids) != q - 1:
                return 0
        return q

    def fits_chain(self, n: int) -> bool:
        return n <= self.B

    def _fill(self, entries: Sequence[tuple], b: int, q: int) -> None:
        """entries: per proposing row (RequestState, first position, positions kept n_valid); q: the catch-up's
        query length (0: the chain's inputs only). Writes the host staging and sends it in one copy."""
        h64, h32, o, o32, bs = self.h64, self.h32, self._o64, self._o32, self.block_size
        B, W, n = self.B, self.W, len(entries)
        bt = h32[o32["bt"][0]:o32["bt"][0] + B * W].reshape(B, W)
        cpos0, cslot0, cseq0 = o["cpos"][0], o["cslots"][0], o32["cseq"][0]
        ids0, pos0, slot0, last0 = o["ids"][0], o["pos"][0], o["slots"][0], o["last"][0]
        seq0, qsl0 = o32["seq"][0], o32["qsl"][0]
        for i, (st, p0, nv) in enumerate(entries):
            blocks = np.asarray(st.block_ids, dtype=np.int64)
            nb = len(blocks)
            bt[i, :min(nb, W)] = blocks[:W]
            p_last = p0 + nv - 1

            def slots_of(pos):
                blk = pos // bs
                return np.where(blk < nb, blocks[np.minimum(blk, max(nb - 1, 0))] * bs + pos % bs, -1) if nb \
                    else np.full(len(pos), -1, dtype=np.int64)
            if q:
                t0 = i * q
                h64[ids0 + t0:ids0 + t0 + q] = 0
                h64[ids0 + t0:ids0 + t0 + nv] = st.token_ids(p0 + 1, p0 + nv + 1)
                pos = np.arange(p0, p0 + q, dtype=np.int64)
                h64[pos0 + t0:pos0 + t0 + q] = pos
                sl = slots_of(pos)
                sl[nv:] = -1  # rejected drafts' positions: no K/V (the eager pass leaves them out)
                h64[slot0 + t0:slot0 + t0 + q] = sl
                h64[last0 + i] = t0 + nv - 1
                h32[seq0 + i] = p0 + q
            if self.k > 1:
                cpos = p_last + np.arange(1, self.k, dtype=np.int64)
                h64[cpos0 + i:cpos0 + i + (self.k - 1) * B:B] = cpos
                h64[cslot0 + i:cslot0 + i + (self.k - 1) * B:B] = slots_of(cpos)
                h32[cseq0 + i:cseq0 + i + (self.k - 1) * B:B] = cpos + 1
        # Padding rows n..b: no K/V write, no context, and (catch-up of q > 1) no query.
        if q:
            h64[ids0 + n * q:ids0 + b * q] = 0
            h64[pos0 + n * q:pos0 + b * q] = 0
            h64[slot0 + n * q:slot0 + b * q] = -1
            # (a padding row's "last" is row 0's first token, a real query: the varlen kernel leaves the output of
            # tokens that belong to no sequence unwritten, which must not feed the chain's padding rows)
            h64[last0 + n:last0 + b] = 0
            h32[seq0 + n:seq0 + b] = 0
            h32[qsl0:qsl0 + n + 1] = np.arange(n + 1) * q
            h32[qsl0 + n + 1:qsl0 + b + 1] = n * q
        for s in range(self.k - 1):
            h64[cpos0 + s * B + n:cpos0 + s * B + b] = 0
            h64[cslot0 + s * B + n:cslot0 + s * B + b] = -1
            h32[cseq0 + s * B + n:cseq0 + s * B + b] = 0
        # One copy, up to row b of the block table (rows past n and entries past a row's blocks are never read:
        # seq_lens bounds every read).
        words = self._n64 + -(-(o32["bt"][0] + b * W) // 2)
        self.raw[:words].copy_(self._host[:words], non_blocking=True)

    def catch_up(self, entries, aux: torch.Tensor, q: int) -> List[List[int]]:
        """The catch-up pass of a decode / verify step's rows (entries as _fill's; aux [n * q, A]), then the chain ->
        the k drafts of each row."""
        n = len(entries)
        b = padded_size(self.sizes_by_q[q], n)
        self._fill(entries, b, q)
        self.aux[:n * q].copy_(aux)
        if self.device.type != "cuda":
            tok0 = self.prepare_catch_up(b, q)[1]()
        else:
            self.catch_up_graphs[(b, q)].replay()
            tok0 = self.tok0[:b]
        if self.k == 1:
            return tok0[:n, None].tolist()
        return self._chain(b)[:n].tolist()

    def chain(self, entries, tok: torch.Tensor, h: torch.Tensor) -> List[List[int]]:
        """The chain after an eager catch-up: tok [n] (draft 1), h [n, H] (its hidden state) -> the k drafts."""
        n = len(entries)
        b = padded_size(self.sizes, n)
        self._fill(entries, b, 0)
        self.tok0[:n].copy_(tok)
        self.h0[:n].copy_(h)
        return self._chain(b)[:n].tolist()

    def _chain(self, b: int) -> torch.Tensor:
        if self.device.type != "cuda":
            return self.prepare_chain(b)[1]()
        self.chain_graphs[b].replay()
        return self.chain_out[b]
