"""The forward context: what layers need to know about the batch being run, without globals.

The runner enters `with forward_context(batch, kv_caches):` around a model call; attention layers
read the batch metadata (slot mapping, block tables, ...) and their cache tensors from it: kv_caches[layer_idx]
is that layer's tensors ((k_cache, v_cache) for full attention), a list or a {layer index: tensors} dict. It lives
at the top of the package because both runner/ (which sets it) and layers/ (which read it) need it.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any

_local = threading.local()


@dataclass
class ForwardContext:
    batch: Any  # runner.forward_batch.ForwardBatch
    kv_caches: Any  # kv_caches[layer_idx]: that layer's cache tensors
    # Hybrid models' prefix caching: state_snapshots[layer_idx], a state layer's (conv, recurrent) snapshot pools,
    # which the layer writes at batch.state_saves (runner/kv_cache.py allocates them); None without snapshots.
    state_snapshots: Any = None

    def state_saves(self, layer_idx: int):
        """(saves, (conv snapshots, recurrent snapshots)) for a state layer this step: the batch's StateSaves
        (kernels/gated_delta/saves.py) and the layer's pools, or (None, (None, None)) when it saves nothing."""
        saves = getattr(self.batch, "state_saves", None)
        if saves is None or self.state_snapshots is None or self.state_snapshots[layer_idx] is None:
            return None, (None, None)
        return saves, self.state_snapshots[layer_idx]


@contextlib.contextmanager
def forward_context(batch: Any, kv_caches: Any, state_snapshots: Any = None):
    prev = getattr(_local, "ctx", None)
    _local.ctx = ForwardContext(batch, kv_caches, state_snapshots)
    try:
        yield _local.ctx
    finally:
        _local.ctx = prev


def get_forward_context() -> ForwardContext:
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        raise RuntimeError("No forward context: model layers must run inside `with forward_context(...)`.")
    return ctx
