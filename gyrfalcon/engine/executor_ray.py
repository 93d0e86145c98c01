"""RayExecutor (`--distributed-executor-backend ray`): the tensor-parallel workers of executor_mp.py as Ray actors,
placed by a placement group of one bundle per rank ({"GPU": 1} on GPUs, {"CPU": 1} on a CPU), so the ranks may
sit on several machines of a Ray cluster.

Only the placement and the workers' lifetime go through Ray. Each actor makes one long call, worker_main (the same
loop as a multiprocessing worker), and the steps travel as they do under "mp": the msgpack bytes of each
ScheduledBatch down one ZeroMQ PUSH socket per rank, rank 0's RunnerOutput back up one PULL socket, over TCP here
(the core binds on its node's IP address) instead of Unix sockets. Why not a Ray call per step: a step of decode
takes milliseconds, and a remote call plus ray.put / ray.get per step adds Ray's scheduling and object-store path
to every one of them; the sockets cost one send of the same bytes, keep async scheduling's queueing (launch sends,
complete reads) and the failure handling of executor_mp.py unchanged. torch.distributed meets at rank 0's node
(its IP and a free port there: the TCP store rank 0 hosts).

A worker's liveness is its actor's call: done (returned, raised, or the actor died) means the rank is gone, which
the executor reports as it reports an exited process. Shutdown tells the workers to stop, then kills the actors
and removes the placement group. Ray is started here (ray.init(), which joins RAY_ADDRESS's cluster when that is
set, else starts a local one) unless the caller already has.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import List, Optional

from gyrfalcon.engine.executor_mp import MultiprocExecutor
from gyrfalcon.engine.executor_worker import worker_main

logger = logging.getLogger(__name__)

# How long the placement group may wait for its bundles before the engine gives up with a clear error.
PLACEMENT_TIMEOUT_S = 60.0
# How long an actor's "alive" answer stands: launch() checks every rank each step, and a ray.wait per rank per
# step would add Ray's round trip to every decode step; a death is still seen within this.
ALIVE_CHECK_INTERVAL_S = 0.05


class _Worker:
    """The run loop of one rank inside a Ray actor (made a Ray actor class by _actor_class)."""

    def node_ip(self) -> str:
        import ray
        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        from gyrfalcon.engine.executor_mp import _free_port
        return _free_port()

    def pid(self) -> int:
        import os
        return os.getpid()

    def run(self, rank: int, config, init_method: str, step_addr: str, result_addr: str) -> None:
        worker_main(rank, config, init_method, step_addr, result_addr, parent_pid=None, exit_process=False)


class _RayWorker:
    """One rank's actor behind multiprocessing.Process's interface (what executor_mp's checks and _stop use)."""

    def __init__(self, actor) -> None:
        self.actor, self.pid = actor, None
        self.ref = None  # the run call's ObjectRef once started
        self.exitcode: Optional[str] = None
        self._alive_at = 0.0  # when is_alive last asked Ray (and heard "alive")

    def _done(self, timeout: float) -> bool:
        import ray
        if self.ref is None:
            return True
        ready, _ = ray.wait([self.ref], timeout=max(0.0, timeout))
        if ready and self.exitcode is None:
            try:
                ray.get(self.ref)
                self.exitcode = "0 (the actor's call returned)"
            except Exception as err:  # noqa: BLE001: why the actor is gone, for the report
                self.exitcode = f"{type(err).__name__} (the actor's call failed)"
        return bool(ready)

    def is_alive(self) -> bool:
        now = time.monotonic()
        if now - self._alive_at < ALIVE_CHECK_INTERVAL_S:
            return True
        alive = not self._done(0.0)
        if alive:
            self._alive_at = now
        return alive

    def join(self, timeout: Optional[float] = None) -> None:
        self._done(timeout if timeout is not None else 1e9)

    def terminate(self) -> None:
        self.kill()

    def kill(self) -> None:
        import ray
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001: already gone
            pass
        if self.ref is not None:
            ray.wait([self.ref], timeout=5.0)
        self.ref = None


class RayExecutor(MultiprocExecutor):
    """MultiprocExecutor with its workers as Ray actors (module docstring)."""

    def __init__(self, config) -> None:
        import ray

        if not ray.is_initialized():
            ray.init()
        self._ray = ray
        self._node_ip = ray.util.get_node_ip_address()
        # The actors and the placement group, released by shutdown, a failure, a failed start or garbage collection.
        self._held: list = []
        self._release = weakref.finalize(self, _release, self._held)
        try:
            super().__init__(config)
        except BaseException:
            self._release()
            raise

    def _bind(self, sock, name: str) -> str:
        port = sock.bind_to_random_port(f"tcp://{self._node_ip}")
        return f"tcp://{self._node_ip}:{port}"

    def _start_workers(self, config, step_addrs: List[str], result_addr: str) -> list:
        ray = self._ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {"GPU": 1, "CPU": 1} if config.device == "cuda" else {"CPU": 1}
        pg = placement_group([dict(bundle) for _ in range(self.world_size)], strategy="PACK")
        self._held.append(pg)
        ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            raise RuntimeError(f"The Ray cluster could not place {self.world_size} workers of {bundle} within "
                               f"{PLACEMENT_TIMEOUT_S:.0f} s (ray.available_resources(): "
                               f"{ray.available_resources()}).")
        actor_cls = ray.remote(_Worker)
        actors = [actor_cls.options(
            num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                 placement_group_bundle_index=r)).remote()
            for r in range(self.world_size)]
        # torch.distributed's rendezvous at rank 0's node (it hosts the TCP store).
        workers = [_RayWorker(a) for a in actors]
        self._held.extend(workers)
        ip, port = ray.get([actors[0].node_ip.remote(), actors[0].free_port.remote()])
        for w, pid in zip(workers, ray.get([a.pid.remote() for a in actors])):
            w.pid = pid
        init_method = f"tcp://{ip}:{port}"
        for r, w in enumerate(workers):
            w.ref = w.actor.run.remote(r, config, init_method, step_addrs[r], result_addr)
        logger.info("Ray: %d worker actors placed (placement group %s), rendezvous at %s", self.world_size,
                    pg.id.hex(), init_method)
        return workers

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            self._release()

    def _fail(self, why: str, kind: Optional[str] = None) -> None:
        try:
            super()._fail(why, kind)
        finally:
            self._release()


def _release(held: list) -> None:
    """Kill the actors (a worker that returned leaves its actor idle) and remove the placement group."""
    import ray
    for item in held:
        if isinstance(item, _RayWorker):
            item.kill()
    for item in held:
        if not isinstance(item, _RayWorker):
            try:
                ray.util.remove_placement_group(item)
            except Exception:  # noqa: BLE001: the cluster is gone already
                pass
    held.clear()
