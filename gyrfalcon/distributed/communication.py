"""The collectives a layer calls, over the tensor-parallel group; the identity at world size 1 (unless forced:
ParallelState.force_collectives).

Inside a CUDA graph capture (runner/cuda_graph.py) they are captured as NCCL kernels and run at every replay; every
rank captures the same ladder, so the ranks' graphs hold the same collectives in the same order."""

from __future__ import annotations

import torch

from gyrfalcon.distributed.parallel_state import get_state, tp_collectives, tp_size


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of x over the ranks, in place (x: each rank's partial result, e.g. a row-parallel GEMM's)."""
    if not tp_collectives():
        return x
    import torch.distributed as dist

    dist.all_reduce(x)
    return x


def tp_all_gather(x: torch.Tensor) -> torch.Tensor:
    """x: [N, C] (2-D) on every rank -> [N, tp * C], rank r's columns at r * C (a vocab-parallel LM head's logits)."""
    tp = tp_size()
    if not tp_collectives():
        return x
    import torch.distributed as dist

    x = x.contiguous()
    n, c = x.shape
    out = torch.empty(tp * n, c, dtype=x.dtype, device=x.device)  # rank r's rows at r * n (gloo wants it flat)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (renamed in newer torch)
    gather(out, x)
    return out.view(tp, n, c).transpose(0, 1).reshape(n, tp * c)


# ---- pipeline parallelism (tensor_parallel_size 1: a stage is one rank, global rank = stage) ----------------------
def pp_send_next(x: torch.Tensor) -> None:
    """Send x (the residual stream after this stage's layers, [T, hidden]) to the next stage."""
    import torch.distributed as dist

    st = get_state()
    dist.send(x.contiguous(), dst=(st.pp_rank + 1) * st.world_size + st.rank)


def pp_recv_prev(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """The previous stage's pp_send_next: a new tensor of `shape` (each rank knows the step's token count)."""
    import torch.distributed as dist

    st = get_state()
    x = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(x, src=(st.pp_rank - 1) * st.world_size + st.rank)
    return x


def pp_broadcast_from_last(x: torch.Tensor) -> torch.Tensor:
    """The last stage's x (the final hidden states [T, hidden]) on every stage, in place: every rank then computes
    the same logits and samples the same tokens, as tensor-parallel ranks do."""
    import torch.distributed as dist

    st = get_state()
    dist.broadcast(x, src=(st.pp_size - 1) * st.world_size + st.rank)
    return x
