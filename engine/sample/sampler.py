"""The sampler: from the model's logits to one token per row (plus optional logprobs)."""

from __future__ import annotations

import torch

from engine.sample.counter_rng import sample_seeded, sample_unseeded
from engine.sample.logprobs import gather_logprobs
from engine.sample.metadata import SAMPLING_EPS, SamplingMetadata
from engine.sample.penalties import apply_penalties
from engine.sample.sampler_output import LogprobsOutput, SamplerOutput
from engine.sample.top_k_top_p import apply_top_k_top_p

__all__ = ["LogprobsOutput", "Sampler", "SamplerOutput"]


class Sampler:
    """vLLM V1's pipeline, in order:

    1. logprobs of the raw logits (what the model said, before any processing);
    2. argmax-changing processors (min_tokens, logit_bias, thinking budget, custom), penalties;
    3. greedy rows: argmax;
    4. random rows: temperature, argmax-invariant processors (min_p), top-k / top-p, draw.

    `logits` may be modified in place: the caller hands over a fresh tensor each step.
    """

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != metadata.num_rows:
            raise ValueError(
                f"logits must be [num_rows={metadata.num_rows}, vocab], got {tuple(logits.shape)}"
            )
        logits = logits.float()
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        for processor in metadata.logitsprocs.non_argmax_invariant:
            logits = processor.apply(logits)
        logits = apply_penalties(logits, metadata)
        sampled = self.sample(logits, metadata)
        logprobs = None
        if raw_logprobs is not None and metadata.max_num_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Steps 3-4 on already processed logits."""
        # Exactly argmax of the float32 logits: the engine is checked token for token against
        # Hugging Face greedy decoding.
        greedy = None if metadata.all_random else logits.argmax(dim=-1)
        temperature = metadata.temperature
        if temperature is None:
            if greedy is None:
                raise ValueError("metadata has no temperature but is not all greedy")
            return greedy
        is_greedy = temperature < SAMPLING_EPS
        # Greedy rows divide by 1: their random draw is discarded, but must not be inf/NaN.
        logits = logits / torch.where(is_greedy, 1.0, temperature).unsqueeze(1)
        for processor in metadata.logitsprocs.argmax_invariant:
            logits = processor.apply(logits)
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        drawn = _draw(torch.softmax(logits, dim=-1), metadata)
        return drawn if greedy is None else torch.where(is_greedy, greedy, drawn)


def _draw(probs: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Random rows: hashed noise where seeded, the generator elsewhere."""
    if metadata.seeds is None or metadata.has_seed is None:
        return sample_unseeded(probs, metadata.generator)
    has_seed = metadata.has_seed
    seeded_rows = has_seed.nonzero().squeeze(1)
    tokens = torch.empty(probs.shape[0], dtype=torch.int64, device=probs.device)
    tokens[seeded_rows] = sample_seeded(
        probs[seeded_rows], metadata.seeds[seeded_rows], metadata.output_positions[seeded_rows]
    )
    # Unseeded rows (greedy ones included: cheap, and overwritten by the caller).
    other_rows = (~has_seed).nonzero().squeeze(1)
    if other_rows.numel():
        tokens[other_rows] = sample_unseeded(probs[other_rows], metadata.generator)
    return tokens
