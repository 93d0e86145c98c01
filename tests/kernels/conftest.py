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
    # rebuild them in interpreter mode (reload order: helpers before the modules using them).
    for _name in sorted(n for n in sys.modules if n.startswith("gyrfalcon.kernels.")):
        importlib.reload(sys.modules[_name])
    if "gyrfalcon.kernels" in sys.modules:
        importlib.reload(sys.modules["gyrfalcon.kernels"])


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
