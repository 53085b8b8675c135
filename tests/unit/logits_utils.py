"""Shared by the logits-processor tests: a tiny vocabulary and batch-update builders."""

from __future__ import annotations

import math

import torch

from engine.request import SamplingParams
from engine.sample.logits_processor import (
    BatchUpdate,
    LogitsProcessor,
    LogitsProcessorConfig,
    MoveDirectionality,
)

CPU = torch.device("cpu")
V = 8
EOS = 7
THINK_START = 5
THINK_END = 6
INF = math.inf
SWAP = MoveDirectionality.SWAP
UNI = MoveDirectionality.UNIDIRECTIONAL
CONFIG = LogitsProcessorConfig(
    vocab_size=V,
    max_num_seqs=4,
    eos_token_id=EOS,
    reasoning_start_token_id=THINK_START,
    reasoning_end_token_id=THINK_END,
)


def update(
    batch_size: int,
    removed: tuple[int, ...] = (),
    added: tuple[tuple[int, SamplingParams, list[int], list[int]], ...] = (),
    moved: tuple[tuple[int, int, MoveDirectionality], ...] = (),
) -> BatchUpdate:
    return BatchUpdate(batch_size, removed, added, moved)


def add(index: int, output: list[int] | None = None, prompt: list[int] | None = None, **kw):
    return (index, SamplingParams(**kw), prompt or [0], output if output is not None else [])


def applied(proc: LogitsProcessor, batch_size: int) -> torch.Tensor:
    return proc.apply(torch.zeros(batch_size, V))


def row(**cols: float) -> list[float]:
    """A logits row of zeros with the given {"t<id>": value} entries."""
    out = [0.0] * V
    for name, value in cols.items():
        out[int(name[1:])] = value
    return out
