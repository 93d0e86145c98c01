"""Paged attention: the layer (layer.py), the backend interface (backend.py) and its reference (plain torch,
the CPU path) and Triton (GPU) implementations."""

from gyrfalcon.layers.attention.backend import AttentionBackend, get_backend
from gyrfalcon.layers.attention.layer import Attention

__all__ = ["Attention", "AttentionBackend", "get_backend"]
