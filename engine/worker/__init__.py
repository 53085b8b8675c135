"""The torch side of an engine: KV tensors, block tables, the persistent batch, the runner."""
