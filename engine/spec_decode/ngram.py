"""Prompt-lookup (n-gram) drafts, and which requests may speculate.

The proposer looks for the sequence's last n tokens (n from `prompt_lookup_max` down to
`prompt_lookup_min`) earlier in the same sequence, prompt and output alike, and proposes the
tokens that followed its most recent earlier occurrence. Where answers repeat spans of their
context (code edits, quoting, extraction) whole runs of drafts are accepted; elsewhere nothing
is found and the request decodes as usual. No model runs: the drafts are free, only their
verification costs (one forward over 1 + k tokens instead of 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.request import SamplingParams


def propose_ngram(
    token_ids: Sequence[int], num_tokens: int, lookup_min: int, lookup_max: int
) -> list[int]:
    """Up to `num_tokens` drafts continuing `token_ids`; [] when no n-gram recurs.

    # tokens  a b c d a b  ->  the suffix "a b" occurred at 0, followed by "c d a b"
    # propose_ngram(tokens, 3, 1, 2) == [c, d, a]
    """
    length = len(token_ids)
    if num_tokens <= 0 or length < 2:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(lookup_max, length - 1), lookup_min - 1, -1):
        suffix = tokens[length - n :]
        # Windows starting before the suffix's own start: an occurrence followed by a token.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.nonzero((windows == suffix).all(axis=1))[0]
        if hits.size:
            start = int(hits[-1]) + n  # the most recent occurrence
            return tokens[start : start + num_tokens].tolist()
    return []


def can_speculate(params: SamplingParams, num_output_tokens: int = 0) -> bool:
    """Requests whose tokens depend only on the model's logits, the temperature, top-k/top-p
    and the seed: their drafts are verified by sampling each drafted position the way plain
    decoding would (engine/spec_decode/verify.py). Anything that reshapes logits by what was
    generated so far or by a per-row state (penalties, min_p, min_tokens, logit bias, grammars,
    budgets, custom processors) and logprobs decode one token at a time; forced first tokens
    (a disaggregated decode continuing the prefill's token) only until they are out."""
    return (
        params.logprobs is None
        and params.min_p == 0.0
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
        and params.repetition_penalty == 1.0
        and params.min_tokens == 0
        and not params.logit_bias
        and params.thinking_token_budget is None
        and not params.extra_args
        and len(params.forced_output_token_ids) <= num_output_tokens
        and params.structured_outputs is None
    )


@dataclass
class SpecDecodeStats:
    """Counts since the engine started (Prometheus counters and `bench latency` read them)."""

    num_drafts: int = 0  # verification steps of a request with at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification step: accepted drafts plus the one sampled token."""
        if not self.num_drafts:
            return 0.0
        return 1.0 + self.num_accepted_tokens / self.num_drafts
