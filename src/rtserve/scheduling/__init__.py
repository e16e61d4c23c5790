"""Request scheduling: the batching policy (decides) and the batcher (does)."""
