"""One tensor-parallel rank's process: join the process group, build a ModelRunner over this rank's shard, then
run every step the engine core sends until told to stop (MultiprocExecutor starts it; executor_mp.py has the
wire format).

Each step arrives as the msgpack bytes of a ScheduledBatch (step_io.encode_batch: plain data, never pickle);
every rank runs the same ModelRunner step, their layers meeting in the collectives, and rank 0 sends back the
RunnerOutput (every rank samples the same tokens from the same all-gathered logits, so the others keep the same
per-request state without sending theirs). A failure is reported as text, then the process exits; so does a
worker whose engine core is gone.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from typing import Optional

# Messages, msgpack arrays. Core -> worker: [STEP, batch bytes] | [SHUTDOWN]. Worker -> core: [READY, rank,
# [num_blocks, num_state_slots, {startup phase: seconds}, num_state_snapshots, state_snapshot_stride,
# bytes_per_block, [decode graph sizes], [prefill graph sizes]]] (graph sizes [] where the rank runs eagerly) |
# [OUTPUT, rank, output bytes] (rank 0 only) |
# [ERROR, rank, [exception type name, text]].
STEP, SHUTDOWN, READY, OUTPUT, ERROR = 1, 2, 10, 11, 12

# How often an idle worker checks that the engine core (its parent) still runs.
PARENT_POLL_MS = 1000


def _cpu_threads(device: str, world_size: int) -> None:
    """On a CPU the ranks share the machine: each gets its share of the cores (unless OMP_NUM_THREADS says)."""
    import torch
    if device != "cpu" or "OMP_NUM_THREADS" in os.environ:
        return
    try:
        ncpu = len(os.sched_getaffinity(0))
    except AttributeError:
        ncpu = os.cpu_count() or 1
    torch.set_num_threads(max(1, ncpu // world_size))


def _graph_sizes(graph_runner) -> list:
    """The sizes a runner's graph ladder captured ([] without one: eager)."""
    return list(graph_runner.sizes) if graph_runner is not None else []


def worker_main(rank: int, config, init_method: str, step_addr: str, result_addr: str, parent_pid: Optional[int],
                exit_process: bool = True) -> None:
    """The process target (multiprocessing spawn), or a Ray actor's one long call (executor_ray.py). config: the
    EngineConfig, handed over once at start. parent_pid: the engine core's pid, whose exit ends this worker (None
    under Ray: the engine core is no parent of an actor, and Ray ends the actors of a driver that exits).
    exit_process: leave with os._exit when done (a Ray actor returns instead, and Ray ends its process)."""
    import msgpack
    import zmq

    from gyrfalcon.engine.core_process import _die_with_parent

    if parent_pid is not None:
        _die_with_parent()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(levelname)s %(asctime)s [tp rank {rank}] %(message)s")
    pc = config.parallel_config
    ctx = zmq.Context(io_threads=1)
    steps = ctx.socket(zmq.PULL)
    results = ctx.socket(zmq.PUSH)
    for s in (steps, results):
        s.setsockopt(zmq.LINGER, 1000)
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.RCVHWM, 0)
    steps.connect(step_addr)
    results.connect(result_addr)
    code = 0
    try:
        from gyrfalcon.distributed import destroy_distributed, init_distributed
        from gyrfalcon.runner.model_runner import ModelRunner
        from gyrfalcon.step_io import decode_batch, encode_output

        _cpu_threads(config.device, pc.world_size)
        init_distributed(rank, pc.tensor_parallel_size, init_method, config.device, pc.enable_expert_parallel,
                         pipeline_parallel_size=pc.pipeline_parallel_size)
        runner = ModelRunner(config)
        results.send(msgpack.packb([READY, rank, [runner.num_blocks, runner.num_state_slots,
                                                  runner.startup_phases, runner.num_state_snapshots,
                                                  runner.state_snapshot_stride, runner.bytes_per_block,
                                                  _graph_sizes(runner.graph_runner),
                                                  _graph_sizes(runner.mixed_graph_runner)]]))
        while True:
            if not steps.poll(PARENT_POLL_MS):
                if parent_pid is not None and os.getppid() != parent_pid:
                    break  # the engine core is gone
                continue
            msg = msgpack.unpackb(steps.recv(), raw=False)
            if msg[0] == SHUTDOWN:
                break
            out = runner.execute(decode_batch(msg[1]))
            if rank == 0:
                results.send(msgpack.packb([OUTPUT, rank, encode_output(out)], use_bin_type=True))
        destroy_distributed()
    except BaseException as err:  # noqa: BLE001: the engine core must hear why
        code = 1
        text = f"{type(err).__name__}: {err}"
        if not isinstance(err, ValueError):
            text += "\n" + traceback.format_exc()
        logging.getLogger("gyrfalcon").error("tensor-parallel rank %d failed: %s", rank, text)
        try:
            results.send(msgpack.packb([ERROR, rank, [type(err).__name__, text]]))
        except Exception:  # noqa: BLE001: the core is gone; nobody to tell
            pass
    finally:
        steps.close(linger=0)
        results.close(linger=1000)
        ctx.term()
        sys.stdout.flush()
        sys.stderr.flush()
    if not exit_process:
        if code:
            raise SystemExit(code)  # (the actor's call fails: the executor sees the rank gone)
        return
    # Skip interpreter teardown (torch / gloo threads can hang it): the sockets are closed.
    os._exit(code)
