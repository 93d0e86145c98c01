"""MLA prefill in the expanded form: which steps take it, and the attention over each sequence's expanded context.

A step whose sequences run many query tokens (prompt prefills, long chunks) attends in the expanded form: every
sequence's latent rows (its cached prefix and this step's tokens, read back from the latent cache after the step's
write) go through kv_b_proj into per-head K_nope [N, H, nope] and V [N, H, v], and kernels/mla_attention's expanded
kernel scores q = [q_nope | roped q_rope] against [K_nope | k_rope] (k_rope shared by the heads). The FLOPs of both
forms are in kernels/mla_attention/expanded.py: expansion costs 2 L H (nope + v) per context row and saves 2 H (L +
R + L - nope - R - v) per (query, key) pair plus W_UK / W_UV per query token, so ExpandedPrefillPlan.flops sums both
for the step and the whole step takes the cheaper form (MultiHeadLatentAttention decides before its prep, which then
only ropes q_rope: no absorbed query). Decode and verify steps never expand (a row of one or a few queries saves far
less than its context's expansion costs); a mixed step expands its decode rows' contexts too when the prefill rows
make the step cheaper that way (the arithmetic counts them). Steps inside a CUDA graph (decode, verify, mixed graphs
of up to 512 tokens) keep the absorbed form: the expansion's shapes follow the host's lengths. V3.2 steps with a
sparse selection stay absorbed (the selection is per query; the kernel here is dense).

Workspace: the context rows are expanded in rounds of at most max(T, MIN_WORKSPACE_ROWS) rows (T: the step's
tokens), each round one gather, one kv_b_proj GEMM and one kernel launch, and rounds merge through their
log-sum-exp (merge_partials). A fresh prompt is one round. The activation profile runs the largest step, so a round
of T rows is what it measured; MIN_WORKSPACE_ROWS keeps a short chunk over a long prefix from needing hundreds of
rounds, at most 2048 x (L + R + H (nope + v)) values beyond that (~130 MiB in bf16 at the real dims, one layer at a
time).

The host needs each sequence's query and context lengths: one device-to-host copy a step, shared by the layers
(the plan is kept for the step's ForwardBatch).
"""

from __future__ import annotations

import weakref
from typing import List, Optional, Tuple

import numpy as np
import torch

from gyrfalcon.kernels.mla_attention import merge_partials, mla_prefill_expanded

MIN_WORKSPACE_ROWS = 2048


class ExpandedPrefillPlan:
    """One step's host-side lengths and expansion rounds. q_lens, seq_lens: int64 [B]; rounds: (slots int64 [n]:
    the cache rows to expand, meta int32 [B, 3]: kernels/mla_attention's (k_start, k_len, delta) per sequence)."""

    def __init__(self, q_lens: np.ndarray, seq_lens: np.ndarray) -> None:
        self.q_lens, self.seq_lens = q_lens, seq_lens
        self._rounds: Optional[List[Tuple[torch.Tensor, torch.Tensor]]] = None

    @classmethod
    def for_batch(cls, fb) -> "ExpandedPrefillPlan":
        """The plan of fb (its lengths copied to the host once; every layer of the step shares it)."""
        global _last
        if _last is not None and _last[0]() is fb:
            return _last[1]
        B = fb.seq_lens.shape[0]
        lens = torch.cat([fb.query_start_loc, fb.seq_lens.to(fb.query_start_loc.dtype)]).cpu().numpy().astype(np.int64)
        plan = cls(np.diff(lens[:B + 1]), lens[B + 1:])
        _last = (weakref.ref(fb), plan)
        return plan

    def flops(self, kv_lora_rank: int, nope: int, rope: int, v: int) -> Tuple[float, float]:
        """(absorbed, expanded) FLOPs per head of the step's attention, the parts that differ between the forms
        (kernels/mla_attention/expanded.py): pairs x scores and values, W_UK / W_UV around the absorbed attention,
        kv_b_proj over the expanded context."""
        q, s = self.q_lens.astype(np.float64), self.seq_lens.astype(np.float64)
        pairs = float((q * (s - q) + q * (q + 1) / 2).sum())
        L = kv_lora_rank
        absorbed = pairs * 2 * (2 * L + rope) + float(q.sum()) * 2 * L * (nope + v)
        expanded = pairs * 2 * (nope + rope + v) + float(s[q > 0].sum()) * 2 * L * (nope + v)
        return absorbed, expanded

    def rounds(self, block_tables: torch.Tensor, block_size: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """Every sequence's context rows (those with queries), cut into rounds of at most max(T, MIN_WORKSPACE_ROWS)
        rows; a sequence's context may span rounds. Built once a step, on the block tables' device."""
        if self._rounds is not None:
            return self._rounds
        B, T = len(self.q_lens), int(self.q_lens.sum())
        cap = max(T, MIN_WORKSPACE_ROWS)
        segs = [(b, 0, int(self.seq_lens[b])) for b in range(B) if self.q_lens[b] > 0 and self.seq_lens[b] > 0]
        self._rounds = []
        while segs:
            meta = np.zeros((B, 3), dtype=np.int32)
            seq_idx, pos, used, rest = [], [], 0, []
            for b, lo, hi in segs:
                n = min(hi - lo, cap - used)
                if n <= 0:
                    rest.append((b, lo, hi))
                    continue
                # Query i of b sits at position (seq_len - q_len) + i; this round's key j at lo + j.
                meta[b] = (used, n, int(self.seq_lens[b] - self.q_lens[b]) - lo)
                seq_idx.append(np.full(n, b, dtype=np.int64))
                pos.append(np.arange(lo, lo + n, dtype=np.int64))
                used += n
                if lo + n < hi:
                    rest.append((b, lo + n, hi))
            segs = rest
            host = torch.from_numpy(np.stack([np.concatenate(seq_idx), np.concatenate(pos)]))
            sp = host.to(block_tables.device, non_blocking=True)
            slots = block_tables[sp[0], sp[1] // block_size].long() * block_size + sp[1] % block_size
            self._rounds.append((slots, torch.from_numpy(meta).to(block_tables.device, non_blocking=True)))
        return self._rounds


_last: Optional[Tuple["weakref.ref", ExpandedPrefillPlan]] = None


def attend_expanded(plan: ExpandedPrefillPlan, q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                    fb, kv_b_proj, num_heads: int, kv_lora_rank: int, v_head_dim: int, scale: float) -> torch.Tensor:
    """q_nope [T, H, nope], q_rope [T, H, R] (roped), cache [num_blocks, block_size, 1, L + R] (this step's rows
    written) -> o [T, H * v] in q's dtype, o_proj's input. kv_b_proj: the layer's Linear, [*, L] -> [*, H (nope +
    v)]."""
    T, H, nope = q_nope.shape
    L = kv_lora_rank
    block_size = cache.shape[1]
    o = lse = None
    for slots, meta in plan.rounds(fb.block_tables, block_size):
        rows = cache[slots // block_size, slots % block_size, 0]  # [n, L + R] (any cache strides: no flatten copy)
        kv = kv_b_proj(rows[:, :L].to(q_nope.dtype)).view(-1, num_heads, nope + v_head_dim)
        # Partials in q's dtype (merged in fp32, as vLLM merges its bf16 prefix / suffix outputs): the kernel has one
        # variant whether a step takes one round or several, so no step compiles a new one mid-run.
        part = mla_prefill_expanded(q_nope, q_rope, kv[..., :nope], rows[:, L:].to(q_nope.dtype), kv[..., nope:],
                                    fb.query_start_loc, meta, scale)
        o, lse = part if o is None else merge_partials(o, lse, *part)
    if o is None:  # no sequence has queries
        return q_nope.new_zeros(T, H * v_head_dim)
    return o.to(q_nope.dtype).reshape(T, H * v_head_dim)
