"""The scheduler process: scheduling policy, KV-cache block manager, and its message loop."""
