"""A weight pulled into L2 on a side branch of the decode graph while a latency-bound kernel runs.

In a batched decode step (Llama-3.1-8B, 16-64 sequences, ~190 tokens of context) every GEMM streams its weight at
70-98% of HBM bandwidth, but decode attention between qkv_proj and o_proj reads its K/V at roughly a quarter to
two thirds of it (README: 11.8 us a layer at batch 16, 17.3 at batch 64). SidePrefetch forks a second stream
from the current one (after qkv_proj), prefetches o_proj's weight into L2 there (kernels/l2_prefetch.py) beside
attention, and joins the fork before o_proj, which then reads its weight from L2. Inside a CUDA-graph capture the
fork and join are the graph's own edges: one replay still runs it all.

GYRFALCON_ATTN_L2_PREFETCH=N (an experiment, default 0: off): decode graphs of 2..N rows do this. Batch 1 is
left out: its o_proj already loads its whole weight before its PDL wait. Only graph captures (and the eager
warm-up before one) fork; an eager step would pay the extra launch on the host.
"""

from __future__ import annotations

import os
from typing import Dict

import torch

from gyrfalcon.kernels._common import capturing_or_warmup
from gyrfalcon.kernels.l2_prefetch import l2_prefetch


def attn_l2_prefetch_rows() -> int:
    """GYRFALCON_ATTN_L2_PREFETCH: the most rows a decode graph may have for SidePrefetch to act (0: off)."""
    return max(0, int(os.environ.get("GYRFALCON_ATTN_L2_PREFETCH", "0") or 0))


def attn_l2_prefetch_evict_last() -> bool:
    """GYRFALCON_ATTN_L2_PREFETCH_EVICT: "last" (default: the prefetched lines outlast attention's streaming K/V)
    or "normal" (the default eviction priority: they do not linger after o_proj)."""
    v = os.environ.get("GYRFALCON_ATTN_L2_PREFETCH_EVICT", "last")
    if v not in ("last", "normal"):
        raise ValueError(f"GYRFALCON_ATTN_L2_PREFETCH_EVICT must be last or normal, not {v!r}")
    return v == "last"


def side_prefetch_wanted(rows: int, capturing: bool) -> bool:
    """Whether a decode step of `rows` rows forks the prefetch: only while capturing (or warming up for) a graph,
    for 2..attn_l2_prefetch_rows() rows."""
    return capturing and 2 <= rows <= attn_l2_prefetch_rows()


_SIDE_STREAMS: Dict[int, torch.cuda.Stream] = {}
FORKS = [0]  # side branches forked so far in this process (tests check that a capture took the path)


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SIDE_STREAMS:
        _SIDE_STREAMS[idx] = torch.cuda.Stream(device=idx)
    return _SIDE_STREAMS[idx]


class SidePrefetch:
    """with SidePrefetch(weight, rows): ...  -- the body (attention) runs on the current stream while `weight` is
    prefetched into L2 on a side stream forked at entry; at exit the current stream waits for the side branch, so
    what follows (o_proj) starts after both. Does nothing unless side_prefetch_wanted(rows, ...) on a CUDA tensor."""

    def __init__(self, weight: torch.Tensor, rows: int) -> None:
        self.weight = weight
        self.active = weight.is_cuda and side_prefetch_wanted(rows, capturing_or_warmup())
        self._done = None

    def __enter__(self) -> "SidePrefetch":
        if self.active:
            main = torch.cuda.current_stream(self.weight.device)
            side = _side_stream(self.weight.device)
            side.wait_stream(main)  # after qkv_proj: the prefetch must not compete with that GEMM's reads
            with torch.cuda.stream(side):
                l2_prefetch(self.weight, evict_last=attn_l2_prefetch_evict_last())
                self._done = torch.cuda.Event()
                self._done.record(side)
            FORKS[0] += 1
        return self

    def __exit__(self, *exc) -> None:
        if self._done is not None:
            torch.cuda.current_stream(self.weight.device).wait_event(self._done)
            self._done = None
