"""One per device: loads the model, owns the KV cache, turns a ScheduledBatch into a forward pass."""
