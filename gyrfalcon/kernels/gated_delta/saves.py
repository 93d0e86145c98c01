"""StateSaves: the in-step state snapshots of one prefill step (hybrid models' prefix caching,
docs/prefix_caching.md), as the Gated DeltaNet prefill ops take them.

Snapshot j holds the state after token row `rows[j]` of the step's ragged batch (the last token of the prefix it
keys, a row of sequence `seqs[j]`) and goes to row `ids[j]` of the layer's snapshot pools (conv [N, K - 1, C],
recurrent [N, HV, dk, dv]). Saves are sorted by sequence, then row; sequence i's are seq_loc[i]:seq_loc[i + 1], so
the chunked rule's program of a sequence walks its own saves in order while it walks its chunks. The same tensors
serve every layer of the step (one snapshot id names a row in every layer's pools).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence, Tuple

import numpy as np
import torch


class StateSaves(NamedTuple):
    seq_loc: torch.Tensor  # [B + 1] int32
    seqs: torch.Tensor  # [NS] int32
    rows: torch.Tensor  # [NS] int32
    ids: torch.Tensor  # [NS] int32

    @property
    def num_saves(self) -> int:
        return self.rows.shape[0]


def save_table(saves: Sequence[Tuple[int, int, int]], query_start_loc: np.ndarray) -> np.ndarray:
    """[B + 1 + 3 NS] int32: seq_loc | seqs | rows | ids, from (sequence, token row, snapshot id) triples in any
    order (host side; state_saves_from_table views the device copy). Rows must lie inside their sequence."""
    B = len(query_start_loc) - 1
    order = sorted(saves, key=lambda s: (s[0], s[1]))
    n = len(order)
    out = np.empty(B + 1 + 3 * n, dtype=np.int32)
    seqs = np.fromiter((s[0] for s in order), dtype=np.int64, count=n)
    rows = np.fromiter((s[1] for s in order), dtype=np.int64, count=n)
    if n and not ((seqs >= 0).all() and (seqs < B).all() and (rows >= query_start_loc[seqs]).all()
                  and (rows < query_start_loc[seqs + 1]).all()):
        raise ValueError(f"State saves outside their sequences' rows: {order} (query_start_loc {query_start_loc}).")
    out[0] = 0
    out[1:B + 1] = np.cumsum(np.bincount(seqs, minlength=B)) if B else ()
    out[B + 1:B + 1 + n] = seqs
    out[B + 1 + n:B + 1 + 2 * n] = rows
    out[B + 1 + 2 * n:] = [s[2] for s in order]
    return out


def state_saves_from_table(table: torch.Tensor, num_seqs: int) -> StateSaves:
    """Views of a save_table (on any device): [B + 1 + 3 NS] int32 -> StateSaves."""
    B = num_seqs
    n = (table.shape[0] - B - 1) // 3
    o = B + 1
    return StateSaves(table[:o], table[o:o + n], table[o + n:o + 2 * n], table[o + 2 * n:o + 3 * n])
