"""layers/side_prefetch.py and kernels/l2_prefetch.py off the GPU: when the side branch forks, and that every
path that cannot prefetch is a no-op that leaves the computation alone (the GPU side: tests/gpu)."""

from __future__ import annotations

import pytest
import torch

from gyrfalcon.kernels.l2_prefetch import LINES_PER_PROGRAM, l2_prefetch, l2_prefetch_launch, l2_prefetch_ref
from gyrfalcon.layers import side_prefetch
from gyrfalcon.layers.side_prefetch import SidePrefetch, attn_l2_prefetch_rows, side_prefetch_wanted


def test_rows_switch_and_when_it_forks(monkeypatch):
    monkeypatch.delenv("GYRFALCON_ATTN_L2_PREFETCH", raising=False)
    assert attn_l2_prefetch_rows() == 0 and not side_prefetch_wanted(16, capturing=True)
    monkeypatch.setenv("GYRFALCON_ATTN_L2_PREFETCH", "64")
    assert attn_l2_prefetch_rows() == 64
    assert side_prefetch_wanted(2, True) and side_prefetch_wanted(64, True)
    assert not side_prefetch_wanted(1, True)  # batch 1: o_proj loads its weight before its PDL wait
    assert not side_prefetch_wanted(65, True)  # above the switch
    assert not side_prefetch_wanted(16, False)  # eager steps never fork


def test_cpu_paths_are_no_ops(monkeypatch):
    """On CPU tensors (and under the interpreter, which runs no PTX) neither the prefetch nor the fork happens,
    the block's body still runs and the tensor is untouched."""
    monkeypatch.setenv("GYRFALCON_ATTN_L2_PREFETCH", "64")
    w = torch.randn(64, 64)
    before = w.clone()
    assert l2_prefetch_ref(w) is None and l2_prefetch(w) is None
    forks = side_prefetch.FORKS[0]
    sp = SidePrefetch(w, 16)
    with sp:
        y = w @ w
    assert not sp.active and side_prefetch.FORKS[0] == forks
    assert torch.equal(w, before) and torch.equal(y, before @ before)


def test_launch_covers_every_line():
    assert l2_prefetch_launch(0) == (0, 0)
    assert l2_prefetch_launch(1) == (1, 1)
    assert l2_prefetch_launch(128 * LINES_PER_PROGRAM) == (LINES_PER_PROGRAM, 1)
    assert l2_prefetch_launch(128 * LINES_PER_PROGRAM + 1) == (LINES_PER_PROGRAM + 1, 2)
    assert l2_prefetch_launch(4096 * 4096 * 2) == (262144, 256)  # Llama-3.1-8B's o_proj


def test_eviction_switch(monkeypatch):
    from gyrfalcon.layers.side_prefetch import attn_l2_prefetch_evict_last
    monkeypatch.delenv("GYRFALCON_ATTN_L2_PREFETCH_EVICT", raising=False)
    assert attn_l2_prefetch_evict_last()
    monkeypatch.setenv("GYRFALCON_ATTN_L2_PREFETCH_EVICT", "normal")
    assert not attn_l2_prefetch_evict_last()
    monkeypatch.setenv("GYRFALCON_ATTN_L2_PREFETCH_EVICT", "first")
    with pytest.raises(ValueError, match="last or normal"):
        attn_l2_prefetch_evict_last()
