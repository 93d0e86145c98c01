"""Capturing CUDA graphs whose steps hold tensor-parallel collectives (NCCL all-reduces), on every rank alike.

A captured NCCL collective communicates only when the graph is replayed, so a capture itself waits for no peer.
What has to hold across the ranks:
- every rank's graphs hold the same collectives in the same order, and every rank replays the graph of the same
  size at the same step: the runner captures the same ladder of sizes on each (runner/cuda_graph.py: the sizes
  come from the config, never from a rank's memory), and each step's batch is the same on every rank;
- the eager runs between the captures (each size's warm-up, which compiles and allocates outside the capture)
  do communicate: were one rank to stop capturing while the others went on, they would wait in the next warm-up's
  all-reduce for it. So after each capture the ranks agree, over the gloo group (distributed.cpu_group: host
  only, nothing queued behind a stream a failed capture may have broken), whether every one of them captured it;
  if one failed, every rank raises GraphCaptureFailed at that same point and the runner goes on without graphs on
  all of them (model_runner.py), whose eager steps then meet in their collectives as before;
- NCCL creates a communicator lazily, at the group's first collective, which must not happen inside a capture:
  warm_up_collectives runs one eager all-reduce first (the activation profile runs some too, but not when the
  block count is given);
- ProcessGroupNCCL's watchdog thread polls the events of earlier collectives (cudaEventQuery) while a capture may
  be under way; the default "global" capture mode makes any such call from any thread invalidate the capture, so
  captures at collectives run in the "thread_local" mode (capture_error_mode), which only checks the capturing
  thread (PyTorch's own NCCL graph tests capture this way).
A failure in a warm-up (out of memory, say) is not agreed on: the peers may already wait in a collective, so it
fails the worker's startup as any error there does, and the executor stops the other ranks (executor_mp.py).
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

from gyrfalcon.distributed.parallel_state import cpu_group, tp_collectives

T = TypeVar("T")


class GraphCaptureFailed(RuntimeError):
    """Some rank could not capture a CUDA graph; raised on every rank at the same capture (agreed_capture)."""


def capture_error_mode() -> str:
    """torch.cuda.graph's capture_error_mode: "thread_local" where the collectives run (module docstring), else
    torch's default."""
    return "thread_local" if tp_collectives() else "global"


def warm_up_collectives(device: torch.device) -> None:
    """One eager all-reduce on `device` and a sync, so that NCCL's communicator exists before any capture."""
    if not tp_collectives():
        return
    import torch.distributed as dist

    x = torch.ones(1, device=device)
    dist.all_reduce(x)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ranks_agree(ok: bool) -> bool:
    """True on every rank if `ok` is True on every rank (an all-reduce MIN over the gloo group); ok itself
    without collectives."""
    if not tp_collectives():
        return ok
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=cpu_group())
    return bool(flag.item())


def agreed_capture(capture: Callable[[], T]) -> T:
    """capture() (one graph's capture, no eager collective in it), then, where the collectives run, the ranks'
    agreement that each captured: GraphCaptureFailed on every rank if any failed (chained to this rank's error
    where it was this one). Without collectives capture()'s own error propagates unchanged."""
    if not tp_collectives():
        return capture()
    err = None
    try:
        out = capture()
    except Exception as e:  # noqa: BLE001: the peers must hear of any failure before this rank moves on
        out, err = None, e
    if not ranks_agree(err is None):
        where = f"this rank: {type(err).__name__}: {err}" if err is not None else "another rank"
        raise GraphCaptureFailed(f"CUDA graph capture failed on {where}") from err
    return out
