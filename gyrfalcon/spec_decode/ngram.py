"""NgramProposer: prompt lookup. The drafts for a sequence are the tokens that followed the latest earlier
occurrence of its longest suffix n-gram (n from prompt_lookup_max down to prompt_lookup_min) in its own prompt +
outputs. It costs no model: code edits, retrieval answers and quoting repeat long spans of the context.

CPU-side, after each step. Each request keeps its tokens in a growing numpy buffer (RequestState.proposer_state:
only the new outputs are appended a step), and a lookup compares only at the earlier occurrences of the last
token, so a step costs O(occurrences x prompt_lookup_max) per request rather than O(context x n) (a 10k-token
context in a batch of hundreds is a real cost on the host)."""

from __future__ import annotations

from typing import List, Sequence

import numpy as np


def ngram_lookup(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> List[int]:
    """tokens: [L] int64 (prompt + outputs). Up to k tokens following the latest earlier match of the longest suffix
    n-gram, n in n_min..n_max; [] when none matches. "Earlier" means a match that ends before the suffix's own
    last token, so at least one token follows it (a match may overlap the suffix)."""
    L = len(tokens)
    if L < 2:
        return []
    ends = np.flatnonzero(tokens[:L - 1] == tokens[L - 1])  # where an earlier match could end
    if ends.size == 0:
        return []
    # lengths[c]: how many tokens ending at ends[c] equal the suffix's last ones, up to n_max.
    lengths = np.zeros(ends.size, dtype=np.int64)
    alive = np.ones(ends.size, dtype=bool)
    for i in range(min(n_max, L - 1)):
        idx = ends - i
        ok = alive & (idx >= 0)
        ok[ok] = tokens[idx[ok]] == tokens[L - 1 - i]
        lengths += ok
        alive = ok
        if not alive.any():
            break
    best = int(lengths.max())
    if best < n_min:
        return []
    start = int(ends[np.flatnonzero(lengths == best)[-1]]) + 1
    return tokens[start:start + k].tolist()


class _Tokens:
    """A request's prompt + outputs as a numpy buffer, grown by doubling."""

    __slots__ = ("buf", "n")

    def __init__(self, st) -> None:
        n = st.num_tokens
        self.buf = np.empty(max(64, 2 * n), dtype=np.int64)
        self.buf[:len(st.prompt_token_ids)] = st.prompt_token_ids
        self.buf[len(st.prompt_token_ids):n] = st.output_token_ids
        self.n = n

    def sync(self, st) -> np.ndarray:
        n = st.num_tokens
        if n > self.n:
            if n > len(self.buf):
                buf = np.empty(2 * n, dtype=np.int64)
                buf[:self.n] = self.buf[:self.n]
                self.buf = buf
            self.buf[self.n:n] = st.token_ids(self.n, n)
            self.n = n
        return self.buf[:n]


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
            if st.proposer_state is None:
                st.proposer_state = _Tokens(st)
            out.append(ngram_lookup(st.proposer_state.sync(st), self.k, self.n_min, self.n_max))
        return out
