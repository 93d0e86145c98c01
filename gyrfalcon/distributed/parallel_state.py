"""ParallelState: this process's rank in the tensor-parallel group, the group's size, and whether MoE layers
split their experts across the ranks (expert parallelism) instead of splitting each expert.

One state per process, set once by init_distributed (a worker of engine/executor_mp.py, before it builds its
ModelRunner) and read by the layers while the model is built: a layer sizes its weights to its rank's shard then,
so the same model code builds the whole model at world size 1. Without init_distributed the state is rank 0 of 1.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelState:
    rank: int = 0
    world_size: int = 1
    # MoE layers: each rank owns world_size-th of the experts, whole (True), or a slice of every expert's
    # intermediate dim (False: tensor parallel inside each expert, vLLM's default).
    expert_parallel: bool = False
    backend: Optional[str] = None  # "nccl" / "gloo" once a process group exists
    # Pipeline parallelism: this process's stage and the number of stages (each stage holds a contiguous run of
    # the decoder layers: pp_layers). The process group holds world_size x pp_size ranks, global rank
    # pp_rank * world_size + rank.
    pp_rank: int = 0
    pp_size: int = 1
    # Run the tensor-parallel collectives through torch.distributed even at world_size 1 (init_distributed's
    # force_collectives): a one-GPU test then captures real NCCL collectives in the CUDA graphs
    # (tests/gpu/test_tp_graphs_gpu.py); they sum over one rank, so the results are unchanged.
    force_collectives: bool = False


_STATE = ParallelState()
# A gloo group over every rank (the world group itself when that is gloo); None without a process group.
_CPU_GROUP = None


def get_state() -> ParallelState:
    return _STATE


def tp_rank() -> int:
    return _STATE.rank


def tp_size() -> int:
    return _STATE.world_size


def tp_collectives() -> bool:
    """Whether the tensor-parallel collectives go through torch.distributed (world_size > 1, or forced at 1);
    else they are the identity and the layers take their single-device paths."""
    return _STATE.world_size > 1 or _STATE.force_collectives


def pp_rank() -> int:
    return _STATE.pp_rank


def pp_size() -> int:
    return _STATE.pp_size


def pp_layers(num_layers: int) -> Tuple[int, int]:
    """[start, end) of the decoder layers this pipeline stage holds: an even split, the earlier stages taking
    the smaller share when it does not divide (the last also runs the final norm and the LM head)."""
    pp, r = _STATE.pp_size, _STATE.pp_rank
    if num_layers < pp:
        raise ValueError(f"pipeline_parallel_size {pp} is larger than the model's {num_layers} layers.")
    return r * num_layers // pp, (r + 1) * num_layers // pp


def expert_parallel() -> bool:
    return _STATE.expert_parallel and _STATE.world_size > 1


def shard_size(n: int, what: str) -> int:
    """n // tp_size(), refusing a dimension that does not split evenly (what: its name, for the message)."""
    tp = _STATE.world_size
    if n % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide {what} ({n}): every rank must hold an equal "
                         "shard; choose a tensor_parallel_size that divides it.")
    return n // tp


def init_distributed(rank: int, world_size: int, init_method: str, device: str = "cpu",
                     expert_parallel: bool = False, timeout_s: float = 600.0,
                     pipeline_parallel_size: int = 1, force_collectives: bool = False) -> ParallelState:
    """Join the process group of `world_size` (tensor-parallel) x `pipeline_parallel_size` ranks at `init_method`
    (tcp://host:port) as global rank `rank`: NCCL when `device` is "cuda" (this rank on cuda:rank: one process per
    GPU of one host), else gloo. timeout_s bounds a collective that a dead peer never joins (the engine notices a
    dead worker sooner, by its process: executor_mp.py). force_collectives: a process group and real collectives
    even at world size 1 (ParallelState.force_collectives; tests only).

    On NCCL a gloo group over the same ranks joins too (cpu_group): the ranks agree through it on whether every
    one captured its CUDA graphs (distributed/graph_capture.py), which must not go through the NCCL stream that
    a failed capture may have left unusable."""
    global _STATE, _CPU_GROUP
    import torch.distributed as dist

    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":  # (under Ray each rank sees only its own GPU: device 0)
        torch.cuda.set_device(rank % torch.cuda.device_count())
        # NCCL >= 2.19 allocates through cuMem by default, which makes every collective captured in a CUDA graph
        # cost memory of its own (NVIDIA/nccl issue 1234: dozens of graphs of dozens of all-reduces each ran
        # out of memory); vLLM turns it off for the same reason. Read by NCCL when it starts, so set before the
        # group's first collective; one set by the user stays.
        os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
    total = world_size * pipeline_parallel_size
    grouped = total > 1 or force_collectives
    if grouped:
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=total, timeout=timeout)
        _CPU_GROUP = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else dist.group.WORLD
    _STATE = ParallelState(rank % world_size, world_size, expert_parallel, backend if grouped else None,
                           rank // world_size, pipeline_parallel_size, force_collectives)
    logger.debug("rank %d of %d joined (%s)", rank, world_size, _STATE.backend)
    return _STATE


def cpu_group():
    """The gloo group over every rank (init_distributed), None without a process group: host-side agreements."""
    return _CPU_GROUP


def destroy_distributed() -> None:
    global _STATE, _CPU_GROUP
    import torch.distributed as dist

    _CPU_GROUP = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _STATE = ParallelState()
