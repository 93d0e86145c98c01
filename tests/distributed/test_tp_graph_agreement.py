"""What of tensor-parallel CUDA graph capture runs without a GPU (distributed/graph_capture.py; the captures
themselves are tested on a GPU: tests/gpu/test_tp_graphs_gpu.py):
- two gloo ranks agree per capture: one rank failing the second of a ladder's captures makes both raise
  GraphCaptureFailed there, neither going on to the third (which would run collectives the other never joins);
- the runner falls back to eager steps on that agreed failure only;
- the config: tensor parallelism on a GPU keeps the graphs, pipeline parallelism turns them off;
- forced collectives at world size 1 (the GPU test's path): a row-parallel projection all-reduces through
  torch.distributed and still computes the plain product."""

from __future__ import annotations

import multiprocessing
import socket

import pytest
import torch

from gyrfalcon.distributed import (GraphCaptureFailed, agreed_capture, destroy_distributed, init_distributed,
                                   ranks_agree, tp_collectives)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, init_method: str, fail_at: int, out) -> None:
    """A ladder of three captures; this rank's capture `fail_at` raises. Reports (what each capture returned or
    the error's type, what ranks_agree said to each rank's own ok)."""
    import torch.distributed as dist
    init_distributed(rank, 2, init_method, "cpu", timeout_s=60)
    try:
        agree = [ranks_agree(True), ranks_agree(rank == 0)]
        got = []
        for i in range(3):
            def capture(i=i):
                if i == fail_at:
                    raise RuntimeError(f"capture {i} failed on rank {rank}")
                return i * 10
            try:
                got.append(agreed_capture(capture))
            except GraphCaptureFailed as err:
                got.append(f"{type(err).__name__}: {err}")
                break
        # The eager steps after a fallback still meet in their collectives.
        x = torch.ones(2) * (rank + 1)
        dist.all_reduce(x)
        out.put((rank, agree, got, x.tolist()))
    finally:
        destroy_distributed()


def test_ranks_fall_back_together():
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    init = f"tcp://127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=_rank_main, args=(r, init, 1 if r == 1 else -1, out), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        res = dict((r, (agree, got, x)) for r, agree, got, x in (out.get(timeout=120) for _ in procs))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    for r in (0, 1):
        agree, got, x = res[r]
        assert agree == [True, False]
        assert got[0] == 0 and len(got) == 2  # the first capture kept, the second failed on both, no third
        assert got[1].startswith("GraphCaptureFailed: CUDA graph capture failed on ")
        assert x == [3.0, 3.0]
    assert "this rank: RuntimeError: capture 1 failed on rank 1" in res[1][1][1]
    assert "another rank" in res[0][1][1]


def test_without_collectives_capture_errors_propagate():
    assert not tp_collectives() and ranks_agree(False) is False
    assert agreed_capture(lambda: 7) == 7
    with pytest.raises(ZeroDivisionError):
        agreed_capture(lambda: 1 / 0)


@pytest.mark.parametrize("tp,pp,eager", [(2, 1, False), (1, 2, True)])
def test_graphs_stay_on_for_tensor_parallel_only(tmp_path, monkeypatch, tp, pp, eager):
    from checkpoints import make_checkpoint
    from gyrfalcon.config import EngineConfig

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    ckpt = make_checkpoint(tmp_path / "m", "llama", num_hidden_layers=2)
    cfg = EngineConfig.create(str(ckpt), device="cuda", dtype="float32", tensor_parallel_size=tp,
                              pipeline_parallel_size=pp)
    assert cfg.enforce_eager is eager


def test_forced_collectives_at_world_size_one():
    from gyrfalcon.layers.linear import RowParallelLinear
    import torch.distributed as dist

    init_distributed(0, 1, f"tcp://127.0.0.1:{_free_port()}", "cpu", timeout_s=60, force_collectives=True)
    try:
        assert tp_collectives() and dist.get_world_size() == 1
        torch.manual_seed(0)
        proj = RowParallelLinear(8, 4, bias=True)
        proj.weight.normal_()
        proj.bias.normal_()
        x, res = torch.randn(3, 8), torch.randn(3, 4)
        calls = []
        orig = dist.all_reduce
        dist.all_reduce = lambda t, *a, **k: (calls.append(t.shape), orig(t, *a, **k))[1]
        try:
            y = proj(x, add_to=res.clone())
        finally:
            dist.all_reduce = orig
        assert calls == [torch.Size([3, 4])]
        torch.testing.assert_close(y, res + x @ proj.weight.T + proj.bias)
        assert ranks_agree(True) and not ranks_agree(False)
    finally:
        destroy_distributed()
    assert not tp_collectives()


def test_runner_falls_back_only_on_an_agreed_failure():
    """ModelRunner._capture_or_fall_back: GraphCaptureFailed (every rank has it) -> False, the steps run eagerly;
    any other capture error (one GPU, or a warm-up's) propagates."""
    from gyrfalcon.runner.model_runner import ModelRunner

    class Ladder:
        def __init__(self, err=None):
            self.err, self.captured = err, False

        def capture(self):
            if self.err is not None:
                raise self.err
            self.captured = True

    ok = Ladder()
    assert ModelRunner._capture_or_fall_back(None, ok) is True and ok.captured
    assert ModelRunner._capture_or_fall_back(None, Ladder(GraphCaptureFailed("on another rank"))) is False
    with pytest.raises(MemoryError):
        ModelRunner._capture_or_fall_back(None, Ladder(MemoryError()))
