"""Sampling: logits processors, penalties, truncation and (counter-based) random draws."""

from engine.sample.metadata import SamplingMetadata
from engine.sample.outputs import LogprobsOutput, SamplerOutput
from engine.sample.sampler import Sampler

__all__ = ["LogprobsOutput", "Sampler", "SamplerOutput", "SamplingMetadata"]
