"""CPU-side bookkeeping of the engine: KV blocks, queues, the scheduler. No torch here."""
