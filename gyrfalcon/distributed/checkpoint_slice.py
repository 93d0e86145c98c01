"""CheckpointSlice: a safetensors tensor not read yet, so that a tensor-parallel rank reads only its shard of it.

Under tensor parallelism the loader hands the model these instead of tensors (models/loader.py); a sharded layer's
weight_loader narrows one to its rank's rows or columns, which reads just that part of the file (safetensors'
get_slice), and everything else takes as_tensor(x), which reads the whole tensor (a replicated norm, a router).
An expert-parallel rank skips other ranks' experts without reading them at all.
"""

from __future__ import annotations

from typing import Any, Union

import torch

# safetensors' dtype names (get_dtype) -> torch dtypes.
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class CheckpointSlice:
    """shape, dtype, dim() like a tensor's; narrow(dim, start, length) and as_tensor() read from the file (which
    must still be open: the loader's generator keeps it open until the next tensor is asked for)."""

    __slots__ = ("_slice", "shape", "dtype")

    def __init__(self, sf_slice: Any) -> None:
        self._slice = sf_slice
        self.shape = torch.Size(sf_slice.get_shape())
        self.dtype = _DTYPES.get(sf_slice.get_dtype())

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if not (0 <= start and start + length <= self.shape[dim]):
            raise ValueError(f"narrow({dim}, {start}, {length}) outside a checkpoint tensor of {tuple(self.shape)}.")
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._slice[index]

    def read(self) -> torch.Tensor:
        return self._slice[:]


def as_tensor(x: Union[torch.Tensor, CheckpointSlice]) -> torch.Tensor:
    """x itself if it is a tensor; the whole tensor read from the file if it is a CheckpointSlice."""
    return x.read() if isinstance(x, CheckpointSlice) else x
