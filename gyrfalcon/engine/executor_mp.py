"""MultiprocExecutor: tensor_parallel_size worker processes on this machine, one per rank, driven by the engine
core as if they were one ModelRunner (the executor interface: executor.py).

    engine core  --PUSH (one per rank)-->  rank r's PULL    [STEP, ScheduledBatch msgpack] | [SHUTDOWN]
    engine core  <--PULL-- every rank's PUSH                [READY, ...] | [OUTPUT, 0, RunnerOutput msgpack] | [ERROR]

Each step's batch is encoded once and the same bytes go to every rank (a broadcast over one PUSH socket per rank:
unlike PUB, nothing sent before a rank connects is lost). launch() sends and returns; complete() waits for rank
0's output, so with async scheduling the next step is already queued on the workers while this one runs. Outputs
come back in launch order.

A worker that dies (killed, out of memory, a failed step) never leaves the engine waiting: while it waits, the
executor checks every rank's process and any ERROR a rank sent, then stops the other ranks and raises
WorkerDied; check_health() does the same between steps (the server's engine core calls it while idle, so a
dead worker makes the server unhealthy even with no request running).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import socket
import tempfile
import time
import weakref
from typing import List, Optional

import torch

from gyrfalcon.step_io import RunnerOutput, ScheduledBatch, decode_output, encode_batch
from gyrfalcon.engine.executor_worker import ERROR, OUTPUT, READY, SHUTDOWN, STEP, worker_main

logger = logging.getLogger(__name__)

# How long the wait for a step's output sleeps between checks of the workers' processes.
LIVENESS_POLL_MS = 100
# How long shutdown waits for a worker to leave by itself before terminating it.
SHUTDOWN_GRACE_S = 5.0


class WorkerDied(RuntimeError):
    """A tensor-parallel worker exited or failed: the engine cannot step any more. kind: the name of the exception
    the worker reported (None when its process just exited)."""

    def __init__(self, message: str, kind: Optional[str] = None) -> None:
        super().__init__(message)
        self.kind = kind


def startup_error(err: WorkerDied) -> Exception:
    """What the engine raises when a worker fails to start: a ValueError for a worker's ValueError (bad settings: a
    dimension the tensor-parallel size does not divide, ...; the server reports those without a traceback), else
    a RuntimeError."""
    cls = ValueError if err.kind == "ValueError" else RuntimeError
    return cls(f"Tensor-parallel startup failed: {err}")


class _Handle:
    """A launched step (Engine reads .batch)."""

    __slots__ = ("batch",)

    def __init__(self, batch: ScheduledBatch) -> None:
        self.batch = batch


def shard_skeleton(config, rank: int):
    """The model as global rank `rank` builds it (its tensor-parallel shard, its pipeline stage's layers), on the
    meta device: the process's ParallelState is set to that rank's while it is built, then restored."""
    from gyrfalcon.distributed import parallel_state
    from gyrfalcon.models.loader import _default_dtype, resolve_model_class

    pc, mc = config.parallel_config, config.model_config
    tp = pc.tensor_parallel_size
    prev = parallel_state._STATE
    parallel_state._STATE = parallel_state.ParallelState(rank % tp, tp, pc.enable_expert_parallel, None, rank // tp,
                                                         pc.pipeline_parallel_size)
    try:
        with _default_dtype(mc.torch_dtype), torch.device("meta"):
            return resolve_model_class(mc.hf_config)(mc.hf_config, max_position=mc.max_model_len)
    finally:
        parallel_state._STATE = prev


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(procs, step_socks, result_sock, ctx, tmpdir, graceful: bool) -> None:
    """Stop the workers and free the sockets (also the finalizer: it must not hold the executor)."""
    import msgpack
    import zmq
    if graceful:
        for s in step_socks:
            try:
                s.send(msgpack.packb([SHUTDOWN]), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
    deadline = time.monotonic() + (SHUTDOWN_GRACE_S if graceful else 0.0)
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(1.0)
    for s in step_socks + [result_sock]:
        s.close(linger=0)
    ctx.term()
    shutil.rmtree(tmpdir, ignore_errors=True)


class MultiprocExecutor:
    def __init__(self, config) -> None:
        import msgpack
        import zmq

        self._msgpack, self._zmq = msgpack, zmq
        self._config = config
        pc = config.parallel_config
        self.world_size = pc.world_size  # (tensor x pipeline parallel ranks)
        self.proposes_drafts = False  # no proposer runs behind an executor yet
        self._tmpdir = tempfile.mkdtemp(prefix="gyrfalcon-tp-")
        self._ctx = zmq.Context(io_threads=1)
        self._results = self._ctx.socket(zmq.PULL)
        self._results.setsockopt(zmq.RCVHWM, 0)
        result_addr = self._bind(self._results, "results")
        self._steps: List = []
        step_addrs = []
        for r in range(self.world_size):
            s = self._ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.LINGER, 0)
            step_addrs.append(self._bind(s, f"steps-{r}"))
            self._steps.append(s)
        self._procs: List = []
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._steps, self._results, self._ctx,
                                           self._tmpdir, True)
        self._dead: Optional[str] = None  # why the workers were stopped, once they were
        self._dead_kind: Optional[str] = None
        self._pending: list = []  # messages read while checking health, not yet consumed by _recv
        self._procs.extend(self._start_workers(config, step_addrs, result_addr))
        ready = {}
        try:
            while len(ready) < self.world_size:
                tag, rank, payload = self._recv()
                if tag == READY:
                    ready[rank] = payload
        except WorkerDied as err:
            raise startup_error(err) from None
        # Every rank sized its cache alike (the same shard shapes); on a GPU free memory may differ: the engine
        # uses the blocks every rank has.
        self.num_blocks = min(r[0] for r in ready.values())
        self.num_state_slots = ready[0][1]
        # Hybrid models' state snapshots (engine/snapshot_pool.py): each rank holds its heads' part of every
        # snapshot, at the same indices; the engine uses the snapshots every rank has, taken at one stride.
        self.num_state_snapshots = min(r[3] for r in ready.values())
        self.state_snapshot_stride = ready[0][4]
        # Rank 0's startup phases (ModelRunner.startup_phases: load, kv sizing, ...), for the benchmarks' report.
        self.startup_phases = dict(ready[0][2])
        # What `bench latency` / `bench throughput` read of a runner besides the model (model: below): rank 0's.
        self.bytes_per_block = ready[0][5]
        self.block_size = config.cache_config.block_size
        self.device = torch.device(config.device)
        # The CUDA graphs live in the workers (every rank captures the same ladders, or none does:
        # distributed/graph_capture.py); rank 0's captured sizes, [] where the steps run eagerly.
        self.graph_runner = self.mixed_graph_runner = None
        self.graph_sizes, self.mixed_graph_sizes = list(ready[0][6]), list(ready[0][7])
        self._model_view = None
        logger.info("tensor parallel: %d worker processes ready (pids %s); CUDA graphs: %s", self.world_size,
                    [p.pid for p in self._procs],
                    f"{len(self.graph_sizes)} decode sizes" if self.graph_sizes else "off")

    @property
    def load_seconds(self) -> float:
        return self.startup_phases.get("load", 0.0)

    @property
    def model(self):
        """Rank 0's shard of the model as a skeleton on the meta device (every parameter's shape and dtype, no
        data), built on first use: what the benchmarks read of the model (weight bytes, layer and MoE shapes) while
        the real one lives in the workers. Never run."""
        if self._model_view is None:
            self._model_view = shard_skeleton(self._config, 0)
        return self._model_view

    # ---- where the workers run (RayExecutor, executor_ray.py, overrides these two) ------------------
    def _bind(self, sock, name: str) -> str:
        """Bind one of the core's sockets -> the address a worker connects to (a Unix socket: same machine)."""
        addr = f"ipc://{self._tmpdir}/{name}"
        sock.bind(addr)
        return addr

    def _start_workers(self, config, step_addrs: List[str], result_addr: str) -> list:
        """Start one worker per rank -> their handles (multiprocessing.Process, or what acts like one:
        is_alive(), join(timeout), terminate(), kill(), pid, exitcode), in rank order."""
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        mp = multiprocessing.get_context("spawn")
        procs = [mp.Process(target=worker_main, name=f"gyrfalcon-tp-rank{r}", daemon=True,
                            args=(r, config, init_method, step_addrs[r], result_addr, os.getpid()))
                 for r in range(self.world_size)]
        for p in procs:
            p.start()
        return procs

    # ---- the runner interface ----------------------------------------------------------------------
    def launch(self, batch: ScheduledBatch) -> _Handle:
        self.check_health()
        data = self._msgpack.packb([STEP, encode_batch(batch)], use_bin_type=True)
        for s in self._steps:
            s.send(data)
        return _Handle(batch)

    def complete(self, handle: _Handle) -> RunnerOutput:
        while True:
            tag, _, payload = self._recv()
            if tag == OUTPUT:
                return decode_output(payload)

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        return self.complete(self.launch(batch))

    def check_health(self) -> None:
        """Raise WorkerDied if a worker exited or reported a failure (non-blocking)."""
        if self._dead is not None:
            raise WorkerDied(self._dead, self._dead_kind)
        zmq = self._zmq
        while True:  # an ERROR may be queued behind nothing: look without waiting
            try:
                data = self._results.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            self._pending.append(data)
        for data in self._pending:
            msg = self._msgpack.unpackb(data, raw=False)
            if msg[0] == ERROR:
                self._fail(f"tensor-parallel worker rank {msg[1]} failed: {msg[2][1]}", msg[2][0])
        self._check_processes()

    def shutdown(self) -> None:
        self._finalizer()

    # ---- waiting -----------------------------------------------------------------------------------
    def _recv(self):
        """The next message from any rank; ERROR or a dead worker raises WorkerDied."""
        while True:
            if self._dead is not None:
                raise WorkerDied(self._dead, self._dead_kind)
            if self._pending:
                data = self._pending.pop(0)
            elif self._results.poll(LIVENESS_POLL_MS):
                data = self._results.recv()
            else:
                self._check_processes()
                continue
            tag, rank, payload = self._msgpack.unpackb(data, raw=False)
            if tag == ERROR:
                self._fail(f"tensor-parallel worker rank {rank} failed: {payload[1]}", payload[0])
            return tag, rank, payload

    def _check_processes(self) -> None:
        dead = [(r, p) for r, p in enumerate(self._procs) if not p.is_alive()]
        if not dead:
            return
        # A worker that failed sent its reason before exiting (its socket lingers until sent): report that rather
        # than the bare exit code when it is on its way.
        while self._results.poll(LIVENESS_POLL_MS):
            data = self._results.recv()
            msg = self._msgpack.unpackb(data, raw=False)
            if msg[0] == ERROR:
                self._fail(f"tensor-parallel worker rank {msg[1]} failed: {msg[2][1]}", msg[2][0])
            self._pending.append(data)
        r, p = dead[0]
        self._fail(f"tensor-parallel worker rank {r} (pid {p.pid}) exited with code {p.exitcode}")

    def _fail(self, why: str, kind: Optional[str] = None) -> None:
        """Stop every worker (the others would wait in a collective for the dead one) and raise."""
        self._dead, self._dead_kind = why, kind
        logger.error("%s; stopping the other workers", why)
        self._finalizer.detach()
        _stop(self._procs, self._steps, self._results, self._ctx, self._tmpdir, graceful=False)
        raise WorkerDied(why, kind)
