"""Eagle3Proposer: k drafts per sequence from an EAGLE-3 head (models/eagle3.py) over the target's aux hidden states.

After each step (ModelRunner.complete, the target's tokens known):
1. one draft pass over every position the step verified or prefilled, for all rows at once: position p takes the
   target's aux hidden state of p and the token at p + 1 (tokens shifted left by one, positions unchanged), so
   the draft's K/V covers every position; a verify step's rejected positions are left out (their hidden states
   came from rejected tokens). The last position's output gives draft 1 (its token p + 1 is the one just sampled).
2. k - 1 one-token passes for the sampling rows, each feeding the previous pass's output and argmax.
Drafts are greedy (argmax of the draft logits, mapped to target ids through d2t): the verify step accepts while
the target samples the same token, which is lossless (docs/spec_decode.md).

The draft's K/V is one more paged layer in the runner's cache plan (cache_specs: its index follows the target's
layers), under the requests' own block tables: the memory budget counts it, a prefix-cache hit brings the draft's
K/V of the cached positions along, and a preempted request recomputes it with the target's. The chained passes
write k - 1 positions past the sequence: the scheduler allocates that many lookahead slots to every sampling row
(num_lookahead_tokens). Each pass is one batched paged-attention call over all rows (the attention backend the
target uses); the argmax of one pass feeds the next one's embedding lookup on the device, and the host reads the
k drafts once at the end. The target's decode, verify and mixed (prefill) graphs return their aux hidden states
(runner/cuda_graph.py, runner/mixed_graph.py: every token's, beside the sampled rows). With CUDA graphs
(capture_graphs: the runner's decode graphs are on) the k - 1 chained passes replay as one graph, and so does the
catch-up pass after a decode or verify step (spec_decode/draft_graph.py); after a prefill or mixed step the catch-up
runs eagerly and the chain still replays.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np
import torch

from gyrfalcon.forward_context import forward_context
from gyrfalcon.models.eagle3 import default_aux_layer_ids, load_eagle3_draft
from gyrfalcon.runner.forward_batch import ForwardBatch


class Eagle3Proposer:
    uses_target_hidden = True

    def __init__(self, config, target_model, device, layer_idx: int) -> None:
        """layer_idx: the draft's index in the cache plan (one past the target's last cached layer)."""
        sc = config.speculative_config
        self.k = sc.num_speculative_tokens
        inner = getattr(target_model, "model", None)
        if not hasattr(inner, "aux_hidden_layers"):
            raise ValueError(f"EAGLE-3 needs the target's hidden states per layer; {type(target_model).__name__} "
                             "does not expose them yet.")
        self.draft = load_eagle3_draft(sc.model, sc.draft_config, target_model, device,
                                       config.model_config.torch_dtype, layer_idx,
                                       max_positions=config.model_config.max_model_len + self.k)
        n = len(inner.layers)
        ids = sc.aux_hidden_state_layer_ids or self.draft.spec.aux_layer_ids or default_aux_layer_ids(n)
        ids = sorted(int(i) for i in ids)
        if len(set(ids)) != 3 or not all(0 <= i <= n for i in ids):
            raise ValueError(f"EAGLE-3 aux hidden-state layers {ids}: three distinct ids in 0..{n} (the target's "
                             "layers).")
        self.aux_layer_ids = ids
        inner.aux_hidden_layers = tuple(ids)
        self.aux: Optional[torch.Tensor] = None  # this step's aux hidden states [T, 3 * H], set by the runner
        self.device = torch.device(device)
        self.kv_caches = None
        self.block_size = 0
        self.graphs = None  # a DraftGraphRunner once capture_graphs / use_graphs ran

    # ---- the runner's side ----------------------------------------------------------------------
    @property
    def num_lookahead_tokens(self) -> int:
        """Slots past a sampling row's tokens that the chained passes write (the scheduler allocates them)."""
        return self.k - 1

    def cache_specs(self, cache_dtype: str) -> dict:
        """{layer index: spec} of the draft's paged K/V, to join the target's in the cache plan."""
        return {self.draft.attn.layer_idx: self.draft.attn.kv_cache_spec(cache_dtype)}

    def bind_caches(self, kv_caches, block_size: int) -> None:
        self.kv_caches, self.block_size = kv_caches, block_size

    def set_step(self, aux: Optional[torch.Tensor]) -> None:
        self.aux = aux

    @property
    def draft_hidden_size(self) -> int:
        """Width of the hidden state a pass feeds the next one."""
        return self.draft.fc.out_features

    @property
    def aux_width(self) -> int:
        """Width of the target's aux hidden states the first pass reads."""
        return self.draft.fc.in_features

    def make_graph_runner(self, max_num_seqs: int, max_model_len: int):
        """A DraftGraphRunner over this proposer's bound caches (its graphs not captured yet)."""
        from gyrfalcon.spec_decode.draft_graph import DraftGraphRunner
        dtype = next(self.draft.parameters()).dtype
        return DraftGraphRunner(self, self.kv_caches, self.block_size, max_num_seqs, max_model_len, self.device,
                                self.aux_width, self.draft_hidden_size, dtype)

    def use_graphs(self, graphs) -> None:
        """Run the passes through `graphs` (a DraftGraphRunner; on a CPU its steps run eagerly: tests), or eagerly
        (None)."""
        self.graphs = graphs

    def capture_graphs(self, graph_runner) -> None:
        """Capture the draft's graphs next to the target's decode graphs (runner/cuda_graph.py CudaGraphRunner,
        already captured): the same batch-size ladder, memory pool and batch-1 PDL choice."""
        g = self.make_graph_runner(graph_runner.sizes[-1], graph_runner.max_model_len)
        with torch.no_grad():  # (an MTP layer's own nn.Linear weights require grad: no autograd tape in a graph)
            g.capture(graph_runner.pool, graph_runner.pdl_choice.get("batch1_pdl"))
        graph_runner.capture_seconds += g.capture_seconds
        self.graphs = g

    # ---- one step's drafts ------------------------------------------------------------------------
    def _batch(self, spans) -> ForwardBatch:
        """spans: per sequence (RequestState, first position, number of positions) -> the draft pass's batch. A
        position past the request's blocks (a chain running beyond max_tokens, whose drafts the scheduler drops)
        writes nothing (slot -1)."""
        bs = self.block_size
        pos_parts, slot_parts, qsl, seq_lens, tables = [], [], [0], [], []
        for st, p0, n in spans:
            blocks = np.asarray(st.block_ids, dtype=np.int64)
            pos = np.arange(p0, p0 + n, dtype=np.int64)
            b = pos // bs
            inside = b < len(blocks)
            pos_parts.append(pos)
            slot_parts.append(np.where(inside, blocks[np.minimum(b, len(blocks) - 1)] * bs + pos % bs, -1)
                              if len(blocks) else np.full(n, -1, dtype=np.int64))
            qsl.append(qsl[-1] + n)
            seq_lens.append(p0 + n)
            tables.append(st.block_ids)
        positions, slots = np.concatenate(pos_parts), np.concatenate(slot_parts)
        # (the table's width padded to a multiple of 16, as the runner's: Triton specializes on its row stride)
        width = -(-max(max(len(t) for t in tables), -(-max(seq_lens) // bs)) // 16) * 16
        bt = torch.zeros(len(tables), width, dtype=torch.int32)
        for i, t in enumerate(tables):
            bt[i, :len(t)] = torch.as_tensor(t, dtype=torch.int32)
        dev = self.device
        q_lens = [n for _, _, n in spans]
        uniform = q_lens[0] if all(q == q_lens[0] for q in q_lens) else 0
        return ForwardBatch(
            input_ids=torch.zeros(len(positions), dtype=torch.int64, device=dev),
            positions=torch.from_numpy(positions).to(dev), slot_mapping=torch.from_numpy(slots).to(dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=bt.to(dev), logits_indices=torch.zeros(0, dtype=torch.int64, device=dev),
            is_decode=uniform == 1, max_query_len=max(q_lens), max_seq_len=max(seq_lens), num_seqs=len(spans),
            uniform_query_len=uniform)

    @torch.inference_mode()
    def propose(self, rows, sampled: Sequence[Sequence[int]]) -> List[List[int]]:
        aux = self.aux
        self.aux = None
        out: List[List[int]] = [[] for _ in rows]
        if aux is None:
            return out
        spans = []  # per sequence the pass covers: (its state, first position, number of positions)
        offsets = []  # each span's first row in `aux`
        last = []  # per proposing row: (row index, its span's index, its last kept position, its state)
        t0 = 0
        for i, r in enumerate(rows):
            n = r.num_new_tokens
            toks = sampled[i]
            # Positions whose tokens are now known: a prefill chunk's all, a verify step's up to the last kept draft
            # (its 1 + k minus the rejected drafts).
            n_valid = n - (len(r.spec_token_ids) - (len(toks) - 1)) if (r.sample and toks) else n
            if r.sample and not toks:
                n_valid = 0  # (a sampling row always yields a token; nothing to cover otherwise)
            if n_valid > 0:
                st = r.request
                if r.sample and toks:
                    last.append((i, len(spans), r.start + n_valid - 1, st))
                spans.append((st, r.start, n_valid))
                offsets.append(t0)
            t0 += n
        if not spans:
            return out
        g = self.graphs
        q = g.catch_up_len(rows, sampled, aux.shape[0]) if g is not None else 0
        if q:  # a decode / verify step's shape: the catch-up and the chain replay their graphs
            for (i, _, _, _), d in zip(last, g.catch_up(spans, aux, q)):
                out[i] = d
            return out
        dev = aux.device
        ids: List[int] = []
        take: List[int] = []  # rows of `aux` the pass reads
        ends = []  # each span's last token's index in the pass
        for (st, p0, n), a in zip(spans, offsets):
            ids.extend(st.token_ids(p0 + 1, p0 + n + 1))
            take.extend(range(a, a + n))
            ends.append(len(ids) - 1)
        aux_rows = aux[torch.tensor(take, device=dev)]
        hidden, normed = self._pass(0, torch.tensor(ids, dtype=torch.int64, device=dev), self._combine(aux_rows),
                                    spans)
        if not last:  # prefill chunks only: the draft's cache now covers them
            return out
        sel = torch.tensor([ends[j] for _, j, _, _ in last], device=dev)
        h = hidden[sel]
        tok = self._tokens(0, normed[sel])
        if g is not None and self.k > 1 and g.fits_chain(len(last)):
            d = g.chain([(st, p_last, 1) for _, _, p_last, st in last], tok, h)
        else:
            drafts = [tok]
            for step in range(1, self.k):
                h, normed = self._pass(step, tok, h, [(st, p_last + step, 1) for _, _, p_last, st in last])
                tok = self._tokens(step, normed)
                drafts.append(tok)
            d = torch.stack(drafts, dim=1).tolist()
        for (i, _, _, _), row in zip(last, d):
            out[i] = row
        return out

    # ---- one pass: what the graphs capture too ----------------------------------------------------
    def _head(self, step: int):
        """The module that runs draft pass `step` (0: the catch-up pass)."""
        return self.draft

    def _combine(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's aux hidden states [T, aux_width] -> the first pass's hidden input [T, H]."""
        return self.draft.combine(aux)

    def _forward(self, step: int, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """Pass `step` inside a forward context -> (the hidden state fed back [T, H], the normed output [T, H])."""
        return self._head(step)(ids, hidden, positions)

    def _tokens(self, step: int, normed: torch.Tensor) -> torch.Tensor:
        """[N, H] -> pass `step`'s greedy tokens as target ids [N] (on the device)."""
        head = self._head(step)
        return head.to_target_ids(head.logits(normed).argmax(dim=-1))

    def _pass(self, step: int, ids: torch.Tensor, hidden: torch.Tensor, spans):
        fb = self._batch(spans)
        with forward_context(fb, self.kv_caches):
            return self._forward(step, ids, hidden, fb.positions)
