"""CheckpointSlice: a safetensors tensor not read yet, so that a tensor-parallel rank reads only its shard of it.

Under tensor parallelism the loader hands the model these instead of tensors (models/loader.py); a sharded layer's
weight_loader narrows one to its rank's rows or columns, which reads just that part of the file (safetensors'
get_slice), and everything else takes as_tensor(x), which reads the whole tensor (a replicated norm, a router).
An expert-parallel rank skips other ranks' experts without reading them at all.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import torch

# safetensors' dtype names (get_dtype) -> torch dtypes.
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class CheckpointSlice:
    """shape, dtype, dim() like a tensor's; narrow(dim, start, length) and as_tensor() read from the file (which
    must still be open: the loader's generator keeps it open until the next tensor is asked for). pick(i, start,
    length) is a lazy view of tensor[i, start:start + length] (one expert of a packed [E, rows, cols] tensor),
    read only when narrowed or read."""

    __slots__ = ("_slice", "_prefix", "shape", "dtype")

    def __init__(self, sf_slice: Any, prefix: Tuple = (), shape: Optional[torch.Size] = None) -> None:
        self._slice = sf_slice
        self._prefix = prefix  # (expert index, rows slice) of a pick, applied before any narrowing
        self.shape = torch.Size(sf_slice.get_shape()) if shape is None else shape
        self.dtype = _DTYPES.get(sf_slice.get_dtype())

    def dim(self) -> int:
        return len(self.shape)

    def pick(self, i: int, start: int = 0, length: Optional[int] = None) -> "CheckpointSlice":
        """tensor[i, start:start + length] of a 3-D (unpicked) tensor, not read yet."""
        if self._prefix or self.dim() != 3:
            raise ValueError(f"pick() takes one 2-D slice of a 3-D checkpoint tensor, not of {tuple(self.shape)}.")
        length = self.shape[1] - start if length is None else length
        if not (0 <= i < self.shape[0] and 0 <= start and start + length <= self.shape[1]):
            raise ValueError(f"pick({i}, {start}, {length}) outside a checkpoint tensor of {tuple(self.shape)}.")
        return CheckpointSlice(self._slice, (i, slice(start, start + length)),
                               torch.Size([length, self.shape[2]]))

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if not (0 <= start and start + length <= self.shape[dim]):
            raise ValueError(f"narrow({dim}, {start}, {length}) outside a checkpoint tensor of {tuple(self.shape)}.")
        index = [slice(None)] * self.dim()
        index[dim] = slice(start, start + length)
        return self._read(index)

    def read(self) -> torch.Tensor:
        return self._read([slice(None)] * self.dim())

    def _read(self, index: list) -> torch.Tensor:
        if self._prefix:  # a pick: tensor[i, rows][index] read as tensor[i, rows narrowed by index[0], index[1]]
            i, rows = self._prefix
            r = index[0]
            start = rows.start + (r.start or 0)
            stop = rows.start + (r.stop if r.stop is not None else rows.stop - rows.start)
            return self._slice[i, start:stop, index[1]]
        return self._slice[tuple(index)]


def as_tensor(x: Union[torch.Tensor, CheckpointSlice]) -> torch.Tensor:
    """x itself if it is a tensor; the whole tensor read from the file if it is a CheckpointSlice."""
    return x.read() if isinstance(x, CheckpointSlice) else x
