"""Model workers: one process per device, holding the model shard, the KV cache and per-request state."""
