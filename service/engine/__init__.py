"""The engine: scheduler, batches, KV pools, workers and sampler."""
