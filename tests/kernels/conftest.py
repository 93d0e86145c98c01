"""Kernel tests: Triton kernels against their plain-torch references, and references against naive math.

Without a GPU the Triton kernels run in the interpreter (TRITON_INTERPRET=1, CPU tensors), which must
be switched on before `triton.jit` decorates the kernels, i.e. before gyrfalcon.kernels is imported.
With a GPU the same tests run the compiled kernels on CUDA tensors.
"""

import importlib
import os
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Another test folder may have imported the kernels first, building GPU-only JIT functions:
    # rebuild them in interpreter mode (common first, then the ops, dependencies first).
    if "gyrfalcon.kernels.common" in sys.modules:
        importlib.reload(sys.modules["gyrfalcon.kernels.common"]).reload_kernel_modules()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
