"""Tensor / expert / pipeline parallelism's process groups and the collectives a layer calls (torch.distributed:
NCCL on GPUs, gloo on CPUs).

It sits below layers/ in the import order (layers call tp_all_reduce; a worker of engine/executor_mp.py sets the
group up) and imports nothing of gyrfalcon's. Every collective is the identity at world size 1, so a single-device
engine never touches torch.distributed and pays nothing.
"""

from gyrfalcon.distributed.checkpoint_slice import CheckpointSlice, as_tensor
from gyrfalcon.distributed.communication import (pp_broadcast_from_last, pp_recv_prev, pp_send_next, tp_all_gather,
                                                 tp_all_reduce)
from gyrfalcon.distributed.graph_capture import (GraphCaptureFailed, agreed_capture, capture_error_mode,
                                                 ranks_agree, warm_up_collectives)
from gyrfalcon.distributed.parallel_state import (ParallelState, cpu_group, destroy_distributed, expert_parallel,
                                                  get_state, init_distributed, pp_layers, pp_rank, pp_size,
                                                  shard_size, tp_collectives, tp_rank, tp_size)

__all__ = ["CheckpointSlice", "GraphCaptureFailed", "ParallelState", "agreed_capture", "as_tensor",
           "capture_error_mode", "cpu_group", "destroy_distributed", "expert_parallel", "get_state",
           "init_distributed", "pp_broadcast_from_last", "pp_layers", "pp_rank", "pp_recv_prev", "pp_send_next",
           "pp_size", "ranks_agree", "shard_size", "tp_all_gather", "tp_all_reduce", "tp_collectives", "tp_rank",
           "tp_size", "warm_up_collectives"]
