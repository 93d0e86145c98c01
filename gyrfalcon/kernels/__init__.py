"""Hot ops of the GPU path: one folder per op, each a Triton kernel beside a plain-torch reference.

Every op folder holds naive.py (the reference: foo_ref, plain torch, CPU or CUDA), the Triton kernel and its
launcher (foo_triton), where it has one its launch-shape rules and tables as data (configs.py), and exports the
dispatcher foo from its __init__: the Triton kernel for CUDA tensors (unless GYRFALCON_KERNELS=ref), the
reference otherwise. Shared helpers live in common.py.
"""

from gyrfalcon.kernels.activation import silu_and_mul
from gyrfalcon.kernels.common import HAS_TRITON
from gyrfalcon.kernels.decode_attention import paged_decode_attention
from gyrfalcon.kernels.paged_attention import paged_attention
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
