"""Eagle3Proposer: k drafts per sequence from an EAGLE-3 head (models/eagle3.py) over the target's aux hidden states.

After each step (ModelRunner.complete, the target's tokens known):
1. one draft pass over every position the step verified or prefilled, for all rows at once: position p takes the
   target's aux hidden state of p and the token at p + 1 (tokens shifted left by one, positions unchanged), so
   the draft's K/V covers every position; a verify step's rejected positions are left out (their hidden states
   came from rejected tokens). The last position's output gives draft 1 (its token p + 1 is the one just sampled).
2. k - 1 one-token passes for the sampling rows, each feeding the previous pass's output and argmax.
Drafts are greedy (argmax of the draft logits, mapped to target ids through d2t): the verify step accepts while
the target samples the same token, which is lossless (docs/spec_decode.md).

The draft's K/V lives per request on the runner's RequestState (`proposer_state`: K and V [capacity, kv_heads,
head_dim], grown by doubling, dropped with the request; a preempted request restarts with a fresh one). Positions
below its `lo` (a prefix-cache hit the target skipped) were never written and are not attended. The passes run
eagerly; the argmax of one feeds the next one's embedding lookup on the device, and the host reads the k drafts
once at the end. The target's decode and verify graphs return their aux hidden states (runner/cuda_graph.py);
its prefill steps run eagerly (the mixed graphs keep only the sampled rows). Capturing the k passes themselves
needs a paged draft cache and fixed-shape attention: still to come.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F

from gyrfalcon.models.eagle3 import default_aux_layer_ids, load_eagle3_draft


class _DraftKV:
    __slots__ = ("k", "v", "lo")

    def __init__(self, capacity: int, kv_heads: int, head_dim: int, like: torch.Tensor, lo: int) -> None:
        self.k = like.new_zeros(capacity, kv_heads, head_dim)
        self.v = like.new_zeros(capacity, kv_heads, head_dim)
        self.lo = lo  # the first position written

    def ensure(self, n: int) -> None:
        if n > self.k.shape[0]:
            cap = max(n, 2 * self.k.shape[0])
            for name in ("k", "v"):
                old = getattr(self, name)
                new = old.new_zeros(cap, *old.shape[1:])
                new[:old.shape[0]] = old
                setattr(self, name, new)


class Eagle3Proposer:
    uses_target_hidden = True

    def __init__(self, config, target_model, device) -> None:
        sc = config.speculative_config
        self.k = sc.num_speculative_tokens
        inner = getattr(target_model, "model", None)
        if not hasattr(inner, "aux_hidden_layers"):
            raise ValueError(f"EAGLE-3 needs the target's hidden states per layer; {type(target_model).__name__} "
                             "does not expose them yet.")
        self.draft = load_eagle3_draft(sc.model, sc.draft_config, target_model, device,
                                       config.model_config.torch_dtype,
                                       max_positions=config.model_config.max_model_len + self.k)
        n = len(inner.layers)
        ids = sc.aux_hidden_state_layer_ids or self.draft.spec.aux_layer_ids or default_aux_layer_ids(n)
        ids = sorted(int(i) for i in ids)
        if len(ids) != 3 or not all(0 <= i <= n for i in ids):
            raise ValueError(f"EAGLE-3 aux hidden-state layers {ids}: three ids in 0..{n} (the target's layers).")
        self.aux_layer_ids = ids
        inner.aux_hidden_layers = tuple(ids)
        self.aux: Optional[torch.Tensor] = None  # this step's aux hidden states [T, 3 * H], set by the runner
        s = self.draft.spec
        self.num_heads, self.kv_heads, self.head_dim = s.num_heads, s.num_kv_heads, s.head_dim
        self.scale = s.head_dim ** -0.5

    def set_step(self, aux: Optional[torch.Tensor]) -> None:
        self.aux = aux

    # ---- attention over each row's draft cache -------------------------------------------------
    def _attend(self, spans):
        """spans: per row (kv, first position, number of positions), in token order -> attend(q, k, v)."""

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out = []
            t = 0
            rep = self.num_heads // self.kv_heads
            for kv, p0, n in spans:
                kv.ensure(p0 + n)
                kv.k[p0:p0 + n] = k[t:t + n]
                kv.v[p0:p0 + n] = v[t:t + n]
                lo = kv.lo
                keys = kv.k[lo:p0 + n].repeat_interleave(rep, dim=1).transpose(0, 1)  # [h, L, d]
                vals = kv.v[lo:p0 + n].repeat_interleave(rep, dim=1).transpose(0, 1)
                qq = q[t:t + n].transpose(0, 1)  # [h, n, d]
                # query i (position p0 + i) sees keys lo..p0 + i
                L = p0 + n - lo
                rows = p0 - lo + torch.arange(n, device=q.device)
                mask = torch.arange(L, device=q.device)[None, :] <= rows[:, None]
                o = F.scaled_dot_product_attention(qq, keys, vals, attn_mask=mask, scale=self.scale)
                out.append(o.transpose(0, 1).reshape(n, -1))
                t += n
            return torch.cat(out)
        return attend

    def _kv(self, st, first_pos: int) -> _DraftKV:
        kv = st.proposer_state
        if kv is None or first_pos < kv.lo:
            kv = _DraftKV(max(64, first_pos + 16), self.kv_heads, self.head_dim, self.draft.fc.weight, first_pos)
            st.proposer_state = kv
        return kv

    @torch.inference_mode()
    def propose(self, rows, sampled: Sequence[Sequence[int]]) -> List[List[int]]:
        aux = self.aux
        self.aux = None
        out: List[List[int]] = [[] for _ in rows]
        if aux is None:
            return out
        dev = aux.device
        ids: List[int] = []
        pos: List[int] = []
        take: List[int] = []  # rows of `aux` the pass reads
        spans = []
        last = []  # per proposing row: (row index, its last token's index in the pass, that position, its cache)
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
                p0 = r.start
                kv = self._kv(st, p0)
                ids.extend(st.token_ids(p0 + 1, p0 + n_valid + 1))
                pos.extend(range(p0, p0 + n_valid))
                take.extend(range(t0, t0 + n_valid))
                spans.append((kv, p0, n_valid))
                if r.sample and toks:
                    last.append((i, len(ids) - 1, p0 + n_valid - 1, kv))
            t0 += n
        if not ids or not last:
            if ids:  # prefill chunks only: fill the draft's cache
                self._pass(ids, pos, aux[torch.tensor(take, device=dev)], spans, dev, combine=True)
            return out
        hidden, normed = self._pass(ids, pos, aux[torch.tensor(take, device=dev)], spans, dev, combine=True)
        sel = torch.tensor([j for _, j, _, _ in last], device=dev)
        h = hidden[sel]
        tok = self._argmax(normed[sel])
        drafts = [tok]
        for step in range(1, self.k):
            p = [p_last + step for _, _, p_last, _ in last]
            step_spans = [(kv, pp, 1) for (_, _, _, kv), pp in zip(last, p)]
            h, normed = self._pass(tok, p, h, step_spans, dev, combine=False)
            tok = self._argmax(normed)
            drafts.append(tok)
        d = torch.stack(drafts, dim=1).tolist()
        for (i, _, _, _), row in zip(last, d):
            out[i] = row
        return out

    def _argmax(self, normed: torch.Tensor) -> torch.Tensor:
        """[N, H] -> the draft's greedy tokens as target ids [N] (on the device)."""
        return self.draft.to_target_ids(self.draft.logits(normed).argmax(dim=-1))

    def _pass(self, ids, pos, hidden, spans, dev, combine: bool):
        ids_t = ids if isinstance(ids, torch.Tensor) else torch.tensor(ids, dtype=torch.int64, device=dev)
        pos_t = torch.tensor(pos, dtype=torch.int64, device=dev)
        if combine:
            hidden = self.draft.combine(hidden.to(self.draft.fc.weight.dtype))
        return self.draft(ids_t, hidden, pos_t, self._attend(spans))
