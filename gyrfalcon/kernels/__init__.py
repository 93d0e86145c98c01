"""Hot ops of the GPU path: each a Triton kernel beside a plain-torch reference.

Every op `foo` exposes foo_ref (plain torch, CPU or CUDA), foo_triton and the dispatcher foo, which runs
the Triton kernel for CUDA tensors (unless GYRFALCON_KERNELS=ref) and the reference otherwise.
"""

from gyrfalcon.kernels._common import HAS_TRITON
from gyrfalcon.kernels.activation import silu_and_mul
from gyrfalcon.kernels.paged_attention import paged_attention
from gyrfalcon.kernels.paged_decode_attention import paged_decode_attention
from gyrfalcon.kernels.rms_norm import rms_norm
from gyrfalcon.kernels.rotary import apply_rotary
from gyrfalcon.kernels.store_kv import store_kv

__all__ = [
    "HAS_TRITON",
    "apply_rotary",
    "paged_attention",
    "paged_decode_attention",
    "rms_norm",
    "silu_and_mul",
    "store_kv",
]
