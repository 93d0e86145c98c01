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


@contextlib.contextmanager
def forward_context(batch: Any, kv_caches: Any):
    prev = getattr(_local, "ctx", None)
    _local.ctx = ForwardContext(batch, kv_caches)
    try:
        yield _local.ctx
    finally:
        _local.ctx = prev


def get_forward_context() -> ForwardContext:
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        raise RuntimeError("No forward context: model layers must run inside `with forward_context(...)`.")
    return ctx
