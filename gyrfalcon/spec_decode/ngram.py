"""NgramProposer: prompt lookup. The drafts for a sequence are the tokens that followed the latest earlier
occurrence of its longest suffix n-gram (n from prompt_lookup_max down to prompt_lookup_min) in its own prompt +
outputs. It costs no model: code edits, retrieval answers and quoting repeat long spans of the context."""

from __future__ import annotations

from typing import List, Sequence

import numpy as np


def ngram_lookup(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> List[int]:
    """tokens: [L] int64 (prompt + outputs). Up to k tokens following the latest earlier match of the longest suffix
    n-gram, n in n_min..n_max; [] when none matches. "Earlier" means a match that ends before the suffix's own
    last token, so at least one token follows it."""
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = tokens[L - n:]
        # Windows starting at 0..L-n-1: every n-gram with at least one token after it (the suffix's own window,
        # starting at L - n, is left out).
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:L - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramProposer:
    def __init__(self, k: int, n_min: int, n_max: int) -> None:
        self.k, self.n_min, self.n_max = k, n_min, n_max

    def propose(self, rows, sampled: Sequence[Sequence[int]]) -> List[List[int]]:
        """rows: the step's ScheduledRequests (their RequestState in .request, outputs already extended with this
        step's tokens); sampled[i]: what row i produced. Drafts only for rows that sampled."""
        out: List[List[int]] = []
        for r, toks in zip(rows, sampled):
            if not toks:
                out.append([])
                continue
            st = r.request
            seq = np.fromiter(st.prompt_token_ids, dtype=np.int64, count=len(st.prompt_token_ids))
            if st.output_token_ids:
                seq = np.concatenate([seq, np.asarray(st.output_token_ids, dtype=np.int64)])
            out.append(ngram_lookup(seq, self.k, self.n_min, self.n_max))
        return out
