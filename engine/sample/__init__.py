"""Sampling: logits processors, penalties, truncation and (counter-based) random draws."""

from engine.sample.metadata import SamplingMetadata
from engine.sample.sampler import Sampler
from engine.sample.sampler_output import LogprobsOutput, SamplerOutput

__all__ = ["LogprobsOutput", "Sampler", "SamplerOutput", "SamplingMetadata"]
