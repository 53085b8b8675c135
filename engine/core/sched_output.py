"""What the scheduler tells the worker each step, and what the worker answers."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from engine.offload.copies import TierCopy, TierReport
from engine.outputs import EngineCoreOutput, TokenLogprobs
from engine.request import Request, SamplingParams


@dataclass
class NewRequestData:
    """A request the worker sees for the first time (its whole state)."""

    req_id: str
    prompt_token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    # Outputs it already has: those it was created with (a request resumed from another
    # engine), or any it sampled before it was first scheduled here.
    output_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_request(cls, request: Request, block_ids: list[int]) -> NewRequestData:
        return cls(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            block_ids=block_ids,
            num_computed_tokens=request.num_computed_tokens,
            sampling_params=request.sampling_params,
            output_token_ids=list(request.output_token_ids),
        )


@dataclass
class CachedRequestData:
    """Requests the worker already knows, as parallel lists (only what changed).

    `new_block_ids[i]` is None when request i got no new block this step. A request resumed
    after preemption lost all its blocks, so for it `new_block_ids[i]` is its whole block
    table (replacing the old one) and `resumed_token_ids` carries every token it has.
    """

    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_block_ids: list[list[int] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    # Outputs the scheduler kept; a worker holding more (a token the scheduler dropped, e.g.
    # sampled over KV that failed to load) truncates to this.
    num_output_tokens: list[int] = field(default_factory=list)
    resumed_token_ids: dict[str, list[int]] = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # {req_id: tokens to compute this step}; prefill chunks and decodes alike.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    preempted_req_ids: set[str]
    # Requests finished since the last step: the worker drops their state.
    finished_req_ids: set[str]
    kv_connector_metadata: Any = None
    # {req_id: drafts}: tokens after the request's last one, computed this step to be verified
    # (they count in num_scheduled_tokens; a request without drafts is absent).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # The scheduler's own: the Requests this step scheduled, and how many requests the
    # scheduler had released by then. With async scheduling an aborted request's id may name
    # a new one by the time the step's output is back: after a release, ids are checked.
    scheduled_requests: list[Request] = field(default_factory=list)
    num_released_requests: int = 0
    # Copies between the primary pool and the KV tier (engine/offload/), in decided order.
    tier_copies: list[TierCopy] = field(default_factory=list)
    tier_copies_first: bool = False  # made before the step runs (a preemption's stores)

    def for_workers(self) -> SchedulerOutput:
        """What the other tensor-parallel ranks' runners read each step: not the scheduler's
        own, nor the tier's copies (rank 0 makes them, in every rank's cache)."""
        return replace(self, scheduled_requests=[], num_released_requests=0, tier_copies=[])


@dataclass
class KVConnectorOutput:
    """The worker-side connector's report for one step.

    finished_sending: requests whose blocks the remote side has read (free them now).
    finished_recving: requests whose asynchronous load ended (successfully or not).
    invalid_block_ids: blocks whose load failed; their KV must be recomputed or the request
    failed, according to the connector's load-failure policy.
    load_problems: request id -> why its load was not used in full (KVConnectorBase.
    take_load_problems), for its trace.
    """

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    load_problems: dict[str, str] = field(default_factory=dict)


@dataclass
class ModelRunnerOutput:
    """Sampled tokens in `req_ids` order; an empty list for a request still in prefill."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    kv_connector_output: KVConnectorOutput | None = None
    # Parallel to req_ids when some request asked for logprobs.
    logprobs: list[list[TokenLogprobs]] | None = None
    # Speculative method draft_model: {req_id: drafts} proposed after this step's samples.
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # The KV tier's copies that ended since the last step (engine/offload/).
    tier_report: TierReport | None = None

    def attach_logprobs(self, outputs: list[EngineCoreOutput]) -> None:
        """Each output gets the logprobs of the tokens it carries."""
        assert self.logprobs is not None
        by_req = dict(zip(self.req_ids, self.logprobs, strict=True))
        for output in outputs:
            entries = by_req.get(output.request_id)
            if entries:
                output.new_logprobs = entries[: len(output.new_token_ids)]


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
