"""Tensor / expert parallelism's process groups and the collectives a layer calls (torch.distributed: NCCL on
GPUs, gloo on CPUs).

It sits below layers/ in the import order (layers call tp_all_reduce; runner/ and the engine's executor set the
group up) and imports nothing of gyrfalcon's. Every collective is the identity at world size 1, so a single-device
engine never touches torch.distributed and pays nothing.
"""

from gyrfalcon.distributed.checkpoint_slice import CheckpointSlice, as_tensor
from gyrfalcon.distributed.communication import all_reduce_min, tp_all_gather, tp_all_reduce
from gyrfalcon.distributed.parallel_state import (ParallelState, destroy_distributed, expert_parallel, get_state,
                                                  init_distributed, shard_size, tp_rank, tp_size)

__all__ = ["CheckpointSlice", "ParallelState", "as_tensor", "all_reduce_min", "destroy_distributed", "expert_parallel", "get_state",
           "init_distributed", "shard_size", "tp_all_gather", "tp_all_reduce", "tp_rank", "tp_size"]
