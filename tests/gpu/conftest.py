"""Shared by the GPU tests: each engine takes a share of the card, so the previous test's must be gone before the
next one sizes its cache."""

import gc

import pytest
import torch


@pytest.fixture(autouse=True)
def _free_gpu_memory():
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
