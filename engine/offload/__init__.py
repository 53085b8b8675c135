"""A KV tier below the primary pool: host memory or a file (docs/ARCHITECTURE.md §8)."""
