"""Benchmarks behind `pdserve bench …`: each prints one JSON object."""
