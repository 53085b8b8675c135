"""The scheduler's side of speculative decoding: proposing drafts, settling verified ones."""

from __future__ import annotations

from collections.abc import Mapping

from engine.config import SpeculativeConfig
from engine.outputs import EngineCoreOutput
from engine.request import Request, RequestStatus
from engine.spec_decode.ngram import SpecDecodeStats, can_speculate, propose_ngram


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.stats = SpecDecodeStats()

    @classmethod
    def create(cls, config: SpeculativeConfig | None, max_model_len: int) -> Speculator | None:
        return cls(config, max_model_len) if config is not None else None

    def settle(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """The step computed KV for every draft; those rejected are not computed tokens (their
        slots are overwritten when the request gets that far again)."""
        request.num_computed_tokens -= num_drafts - num_accepted
        request.spec_token_ids = []
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted

    def wants_drafts(self, request: Request) -> bool:
        return can_speculate(request.sampling_params, request.num_output_tokens)

    @property
    def needs_lookahead(self) -> bool:
        """Whether any request ever gets lookahead slots (lookahead_tokens is 0 otherwise)."""
        return self.config.uses_draft_model

    def lookahead_tokens(self, request: Request) -> int:
        """KV slots to hold past a step's tokens: a draft model writes the K/V of its drafts
        there once the step's sample is out (method draft_model; n-gram drafts need none)."""
        if not self.config.uses_draft_model:
            return 0
        after_this_step = request.num_output_tokens + request.num_output_placeholders + 1
        return self.config.num_speculative_tokens * can_speculate(
            request.sampling_params, after_this_step
        )

    def propose(
        self,
        requests: Mapping[str, Request],
        outputs: list[EngineCoreOutput],
        model_drafts: Mapping[str, list[int]],
    ) -> None:
        """Drafts for the next step of every request that got tokens and is still running:
        found by n-gram lookup, or those the runner's draft model proposed."""
        config = self.config
        for output in outputs:
            request = requests.get(output.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            request.spec_token_ids = []
            # A sample still in flight (async scheduling) would sit before any draft made now.
            if request.num_output_placeholders or not self.wants_drafts(request):
                continue
            # Never past the context, nor past max_tokens (the token verified last is free).
            room = min(
                config.num_speculative_tokens,
                self.max_model_len - request.num_tokens,
                request.max_tokens - request.num_output_tokens - 1,
            )
            if room <= 0:
                continue
            if config.uses_draft_model:
                request.spec_token_ids = list(model_drafts.get(output.request_id, ()))[:room]
            else:
                request.spec_token_ids = propose_ngram(
                    request.all_token_ids, room, config.prompt_lookup_min, config.prompt_lookup_max
                )


def lookahead_tokens(speculator: Speculator | None, request: Request) -> int:
    """KV slots `request` needs past a step's tokens (none without speculation)."""
    return speculator.lookahead_tokens(request) if speculator is not None else 0


def drafts_that_fit(request: Request, drafts: list[int], num_new_tokens: int) -> list[int]:
    """Of a running request's drafts, those that fit in the step's `num_new_tokens` for it, to
    be verified."""
    fit = request.num_computed_tokens + num_new_tokens - len(request.all_token_ids)
    return drafts[:fit] if fit > 0 else []
