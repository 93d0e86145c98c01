"""StateManager: fixed-size per-request state slots for the layers that keep no per-token cache.

A Gated DeltaNet layer keeps, per request, a short conv window and a recurrent matrix whose size does not
grow with the sequence (cache_spec.LinearStateSpec). The runner allocates a pool of `num_slots` such slots
per layer; a running request holds one slot index, the same in every state layer, from its admission to its
end (or preemption: a preempted request recomputes its state from scratch, so its slot is freed too).
"""

from __future__ import annotations

from typing import List

from gyrfalcon.engine.request import Request


class StateManager:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"A state pool needs at least one slot, got {num_slots}.")
        self.num_slots = num_slots
        # Lowest index first: a small batch keeps its states in the head of each pool.
        self._free: List[int] = list(range(num_slots - 1, -1, -1))

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def allocate(self, request: Request) -> bool:
        """Give `request` a slot unless it holds one; False (no change) when none is free."""
        if request.state_slot is not None:
            return True
        if not self._free:
            return False
        request.state_slot = self._free.pop()
        return True

    def free(self, request: Request) -> None:
        if request.state_slot is not None:
            self._free.append(request.state_slot)
            request.state_slot = None
