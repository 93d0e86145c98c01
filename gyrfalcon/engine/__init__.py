"""CPU-side bookkeeping, no CUDA: Engine.step(), Request, Scheduler, BlockManager."""
