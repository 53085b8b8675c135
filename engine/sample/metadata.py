"""Per-step sampling inputs, batched into tensors row by row."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.request import SamplingParams
from engine.sample.logits_processor import LogitsProcessors

# Below this temperature a row is sampled greedily (dividing by it would overflow).
SAMPLING_EPS = 1e-5

_U64 = (1 << 64) - 1


def to_int64_seed(seed: int) -> int:
    """A Python int seed as the int64 with the same low 64 bits (torch has no uint64)."""
    seed &= _U64
    return seed - (1 << 64) if seed >= 1 << 63 else seed


@dataclass
class SamplingMetadata:
    """Everything the sampler needs for one step; row i is the i-th request of the batch.

    A tensor is None when no row needs it, so the sampler can skip that stage entirely.
    """

    temperature: torch.Tensor | None  # [B] float32; greedy rows hold their raw (~0) value
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None  # [B] float32, 1.0 = off
    top_k: torch.Tensor | None  # [B] int64, -1 = off
    # Seeds of the seeded *random* rows (greedy rows ignore their seed).
    seeds: torch.Tensor | None  # [B] int64
    has_seed: torch.Tensor | None  # [B] bool
    output_positions: torch.Tensor  # [B] int64: outputs so far = index of the sampled token
    generator: torch.Generator | None  # for unseeded random rows; None: torch's default
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    presence_penalties: torch.Tensor | None  # [B] float32
    frequency_penalties: torch.Tensor | None  # [B] float32
    repetition_penalties: torch.Tensor | None  # [B] float32
    max_num_logprobs: int | None
    logitsprocs: LogitsProcessors

    @property
    def num_rows(self) -> int:
        return len(self.output_token_ids)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[list[int]],
        output_token_ids: Sequence[list[int]],
        logitsprocs: LogitsProcessors,
        device: torch.device,
        generator: torch.Generator | None = None,
    ) -> SamplingMetadata:
        """Batch the rows in the given order (it must match the logits' rows)."""
        if not len(params) == len(prompt_token_ids) == len(output_token_ids):
            raise ValueError(
                f"one entry per row expected: {len(params)} params, "
                f"{len(prompt_token_ids)} prompts, {len(output_token_ids)} outputs"
            )
        greedy = [p.temperature < SAMPLING_EPS for p in params]
        random_params = [p for p, g in zip(params, greedy, strict=True) if not g]
        seeds, has_seed = _seeds(params, greedy, device)
        return cls(
            temperature=_floats([p.temperature for p in params], device) if random_params else None,
            all_greedy=all(greedy),
            # An empty batch counts as all greedy (nothing to draw), not also all random.
            all_random=bool(params) and not any(greedy),
            top_p=_floats([p.top_p for p in params], device)
            if any(p.top_p < 1.0 for p in random_params)
            else None,
            top_k=_longs([p.top_k for p in params], device)
            if any(p.top_k > 0 for p in random_params)
            else None,
            seeds=seeds,
            has_seed=has_seed,
            output_positions=_longs([len(out) for out in output_token_ids], device),
            generator=generator,
            prompt_token_ids=list(prompt_token_ids),
            output_token_ids=list(output_token_ids),
            presence_penalties=_penalty(params, "presence_penalty", 0.0, device),
            frequency_penalties=_penalty(params, "frequency_penalty", 0.0, device),
            repetition_penalties=_penalty(params, "repetition_penalty", 1.0, device),
            max_num_logprobs=max(
                (p.logprobs for p in params if p.logprobs is not None), default=None
            ),
            logitsprocs=logitsprocs,
        )


def _floats(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _longs(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _seeds(
    params: Sequence[SamplingParams], greedy: list[bool], device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    seeded = [p.seed is not None and not g for p, g in zip(params, greedy, strict=True)]
    if not any(seeded):
        return None, None
    values = [to_int64_seed(p.seed) if p.seed is not None else 0 for p in params]
    return _longs(values, device), torch.tensor(seeded, dtype=torch.bool, device=device)


def _penalty(
    params: Sequence[SamplingParams], name: str, neutral: float, device: torch.device
) -> torch.Tensor | None:
    values = [float(getattr(p, name)) for p in params]
    if all(v == neutral for v in values):
        return None
    return _floats(values, device)
