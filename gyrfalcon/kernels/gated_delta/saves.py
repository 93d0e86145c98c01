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


def _pad4(n: int) -> int:
    return -(-n // 4) * 4


def save_table_size(num_seqs: int, num_saves: int) -> int:
    """int32 words of a save_table: seq_loc, seqs, rows and ids, each section padded to 4 words (16 bytes: Triton
    compiles a kernel variant per pointer alignment, so no section may start where the batch's shape puts it)."""
    return _pad4(num_seqs + 1) + 3 * _pad4(num_saves)


def save_table(saves: Sequence[Tuple[int, int, int]], query_start_loc: np.ndarray) -> np.ndarray:
    """[save_table_size(B, NS)] int32: seq_loc | seqs | rows | ids (16-byte aligned sections), from (sequence, token
    row, snapshot id) triples in any order (host side; state_saves_from_table views the device copy). Rows must lie
    inside their sequence."""
    B = len(query_start_loc) - 1
    order = sorted(saves, key=lambda s: (s[0], s[1]))
    n = len(order)
    seqs = np.fromiter((s[0] for s in order), dtype=np.int64, count=n)
    rows = np.fromiter((s[1] for s in order), dtype=np.int64, count=n)
    if n and not ((seqs >= 0).all() and (seqs < B).all() and (rows >= query_start_loc[seqs]).all()
                  and (rows < query_start_loc[seqs + 1]).all()):
        raise ValueError(f"State saves outside their sequences' rows: {order} (query_start_loc {query_start_loc}).")
    out = np.zeros(save_table_size(B, n), dtype=np.int32)
    o, m = _pad4(B + 1), _pad4(n)
    out[1:B + 1] = np.cumsum(np.bincount(seqs, minlength=B)) if B else ()
    out[o:o + n] = seqs
    out[o + m:o + m + n] = rows
    out[o + 2 * m:o + 2 * m + n] = [s[2] for s in order]
    return out


def state_saves_from_table(table: torch.Tensor, num_seqs: int, num_saves: int) -> StateSaves:
    """Views of a save_table (on any device) of num_seqs sequences and num_saves saves -> StateSaves."""
    o, m, n = _pad4(num_seqs + 1), _pad4(num_saves), num_saves
    return StateSaves(table[:num_seqs + 1], table[o:o + n], table[o + m:o + m + n], table[o + 2 * m:o + 2 * m + n])
