"""SnapshotPool: which linear-attention state snapshots exist, for exact prefix caching of hybrid models.

A Gated DeltaNet layer's state after token p summarizes the whole prefix 0..p: a cached KV prefix alone cannot
resume such a model, the state at the end of that prefix must be restored too. So the runner keeps a pool of
`num_snapshots` copies of a request's state-slot contents (every state layer's conv window and recurrent
matrix; runner/kv_cache.py allocates them), and this class decides which prefix each one holds: a snapshot is
keyed by the chained block hash of the prefix it ends (engine/block_manager.py), so it is the state after
exactly (j + 1) * block_size tokens when it is keyed by block j's hash.

The copies themselves are the runner's, ordered through the plain-data batch (ScheduledBatch.state_restores
copied into slots before the step's forward, state_saves written by the Gated DeltaNet layers during it, at block
boundaries inside the step's prefill chunks). A save scheduled in step N is only on the device once step N has
run, so it stays `pending` (neither restorable nor evictable) until the scheduler starts step N + 1: a request
admitted in the same step as the save would otherwise read the snapshot before it is written.

Ready snapshots sit in an LRU order of their own (restores refresh them; the head is evicted for a new save).
Nothing else holds a snapshot: a request that restores one copies it into its own slot, so preemption and
aborts have nothing to release here, and a snapshot whose KV blocks were evicted meanwhile is never used (a hit
needs both) and ages out of the LRU order.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List, Optional


class SnapshotPool:
    def __init__(self, num_snapshots: int, stride: int) -> None:
        if num_snapshots < 1:
            raise ValueError(f"A snapshot pool needs at least one snapshot, got {num_snapshots}.")
        if stride < 1:
            raise ValueError(f"The snapshot stride must be at least one block, got {stride}.")
        self.num_snapshots = num_snapshots
        # Blocks between the snapshots taken inside a prompt (the prompt's last boundary is always taken).
        self.stride = stride
        self._ready: "OrderedDict[bytes, int]" = OrderedDict()  # prefix hash -> snapshot id, least recent first
        self._pending: Dict[bytes, int] = {}  # saved by the step being scheduled
        self._free: List[int] = list(range(num_snapshots - 1, -1, -1))  # lowest id first
        self.num_saves = 0
        self.num_restores = 0
        self.num_evictions = 0

    @property
    def num_cached(self) -> int:
        return len(self._ready) + len(self._pending)

    def begin_step(self) -> None:
        """The step scheduled last has been launched: its saves precede, on the device, whatever is scheduled
        from now on, so its snapshots become restorable (the most recent in the LRU order)."""
        if self._pending:
            self._ready.update(self._pending)
            self._pending.clear()

    def contains(self, prefix_hash: bytes) -> bool:
        """Whether a snapshot of this prefix exists or is being saved (no second save is needed)."""
        return prefix_hash in self._ready or prefix_hash in self._pending

    def lookup(self, prefix_hash: bytes) -> Optional[int]:
        """The id of a restorable snapshot of this prefix, or None."""
        return self._ready.get(prefix_hash)

    def touch(self, prefix_hash: bytes) -> None:
        """A restore of this prefix was scheduled: it becomes the most recently used."""
        self._ready.move_to_end(prefix_hash)
        self.num_restores += 1

    @property
    def num_available(self) -> int:
        """Snapshots a step can still reserve: free ones and ready ones (evicted); pending ones are taken."""
        return len(self._free) + len(self._ready)

    def reserve(self, prefix_hash: bytes) -> Optional[int]:
        """An id for a new snapshot of this prefix, taken by the step being scheduled: a free one, else the
        least recently used ready one (evicted). None when every snapshot is pending this step."""
        if self._free:
            sid = self._free.pop()
        elif self._ready:
            _, sid = self._ready.popitem(last=False)
            self.num_evictions += 1
        else:
            return None
        self._pending[prefix_hash] = sid
        self.num_saves += 1
        return sid

    def reset(self) -> None:
        """Forget every snapshot (the prefix cache was reset)."""
        self._free = list(range(self.num_snapshots - 1, -1, -1))
        self._ready.clear()
        self._pending.clear()
