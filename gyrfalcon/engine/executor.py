"""The Engine's runner, behind one interface whatever the parallelism: create_executor(config).

An executor is what Engine calls `runner`: launch(batch) -> a handle with .batch, complete(handle) ->
RunnerOutput (step_io.py), num_blocks, num_state_slots, proposes_drafts, and optionally check_health() (raises
when a part of it died) and shutdown(). Two kinds:

- in-process (tensor_parallel_size 1): the ModelRunner itself, the path every single-device engine takes, with
  nothing between the Engine and it;
- multiprocess (tensor_parallel_size or pipeline_parallel_size > 1, backend "mp"): MultiprocExecutor
  (executor_mp.py), one worker process per rank, each with its own ModelRunner over its shard of the model
  (docs/parallelism.md);
- Ray (backend "ray"): RayExecutor (executor_ray.py), the same workers as Ray actors in a placement group.

The runner is imported inside create_executor, so engine/ itself stays free of CUDA code.
"""

from __future__ import annotations


def create_executor(config):
    pc = config.parallel_config
    if pc.world_size == 1:
        from gyrfalcon.runner.model_runner import ModelRunner
        return ModelRunner(config)
    if pc.distributed_executor_backend not in ("mp", "ray"):
        raise ValueError(f"Unknown distributed_executor_backend {pc.distributed_executor_backend!r}.")
    # What cannot shard is refused here, before any worker starts (each rank would fail the same way, later).
    from gyrfalcon.models.loader import check_tensor_parallel
    from gyrfalcon.models.registry import resolve_model_class
    mc = config.model_config
    check_tensor_parallel(resolve_model_class(mc.hf_config), pc.tensor_parallel_size)
    if pc.distributed_executor_backend == "ray":
        from gyrfalcon.engine.executor_ray import RayExecutor
        return RayExecutor(config)
    from gyrfalcon.engine.executor_mp import MultiprocExecutor
    return MultiprocExecutor(config)
