"""Every environment variable gyrfalcon reads, in one place, typed, read once.

Settings that a user picks per run are EngineConfig fields (CLI flags, `LLM()` keywords); these are the few
that belong to the process rather than to one engine: debugging switches, logging, the server's key.
`get()` reads them on first use and caches them; `refresh()` makes the next get() read them again
(tests that set a variable).

| variable | values | what it does |
|---|---|---|
| GYRFALCON_KERNELS | triton (default), ref | `ref` runs the plain-torch reference of every kernel, also on a GPU |
| GYRFALCON_DISABLE_FUSION | 0 (default), 1 | `1`: unfused layers (separate norm, RoPE, K/V store launches), for fused-vs-unfused benchmarks |
| GYRFALCON_PDL | auto (default), 1, 0, serial | programmatic dependent launch in batch-1 decode graphs: `auto` times both at startup and keeps the faster; `serial`: the PDL kernel variants launched without the attribute (the reference for PDL races) |
| GYRFALCON_GC_FREEZE | unset (default), 1, 0 | freeze the startup objects out of the garbage collector's sight (default: the server's engine core does, the offline LLM freezes only for the length of each generate call); `0`: never |
| GYRFALCON_LOG_LEVEL | INFO (default), DEBUG, ... | the server's and engine core's log level |
| GYRFALCON_LOG_STATS_INTERVAL | seconds, 10 (default) | how often the server logs throughput and cache use |
| GYRFALCON_API_KEY | a key | the server requires `Authorization: Bearer KEY` (the `--api-key` flag wins) |
| GYRFALCON_COMMIT | a commit id | the commit benchmarks record where the tree has no git metadata (the GPU machine's copy) |
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

NAMES = ("GYRFALCON_KERNELS", "GYRFALCON_DISABLE_FUSION", "GYRFALCON_PDL", "GYRFALCON_GC_FREEZE",
         "GYRFALCON_LOG_LEVEL", "GYRFALCON_LOG_STATS_INTERVAL", "GYRFALCON_API_KEY", "GYRFALCON_COMMIT")


@dataclass(frozen=True)
class Envs:
    kernels: str  # "triton" or "ref"
    disable_fusion: bool
    pdl: str  # "auto", "1", "0" or "serial"
    gc_freeze: Optional[bool]  # None: the caller's default
    log_level: str
    log_stats_interval: float
    api_key: Optional[str]
    commit: str


def _read() -> Envs:
    e = os.environ
    kernels = e.get("GYRFALCON_KERNELS", "triton") or "triton"
    if kernels not in ("triton", "ref"):
        raise ValueError(f"GYRFALCON_KERNELS={kernels!r}: expected 'triton' or 'ref'")
    pdl = e.get("GYRFALCON_PDL", "auto") or "auto"
    if pdl not in ("auto", "1", "0", "serial"):
        raise ValueError(f"GYRFALCON_PDL={pdl!r}: expected 'auto', '1', '0' or 'serial'")
    gc = e.get("GYRFALCON_GC_FREEZE")
    return Envs(
        kernels=kernels,
        disable_fusion=e.get("GYRFALCON_DISABLE_FUSION", "0") == "1",
        pdl=pdl,
        gc_freeze=None if gc in (None, "") else gc == "1",
        log_level=e.get("GYRFALCON_LOG_LEVEL", "INFO") or "INFO",
        log_stats_interval=float(e.get("GYRFALCON_LOG_STATS_INTERVAL", "10") or 10),
        api_key=e.get("GYRFALCON_API_KEY") or None,
        commit=e.get("GYRFALCON_COMMIT", ""),
    )


_cached: Optional[Envs] = None


def get() -> Envs:
    global _cached
    if _cached is None:
        _cached = _read()
    return _cached


def refresh() -> None:
    """Forget what was read: the next get() reads the environment again (tests that set a variable)."""
    global _cached
    _cached = None
