"""Bounded admission: an engine refuses a prompt it could not start on soon, at once, rather
than queueing work without end (the caller answers RESOURCE_EXHAUSTED / HTTP 429, and the
client retries later or elsewhere). A prompt of higher priority (a smaller `priority`, vLLM's
order) may displace waiting prompts of lower priority that have not started: they are refused
in its place, as if they had arrived to a full queue."""

from __future__ import annotations

from collections.abc import Iterable

from engine.request import Request, RequestStatus


def check_new_request(request: Request, max_model_len: int) -> str | None:
    """ValueError for a request the scheduler must not take; the error to end it with where
    its prompt is longer than `max_model_len` (it ends at once, FINISHED_IGNORED); else None."""
    if request.status != RequestStatus.WAITING or request.num_computed_tokens:
        raise ValueError(f"request {request.request_id!r} was already scheduled once")
    if request.output_token_ids and request.num_tokens >= max_model_len:
        raise ValueError(
            f"request {request.request_id!r}: its prompt and {request.num_output_tokens} "
            f"output tokens fill max_model_len={max_model_len}; nothing is left to generate"
        )
    if request.num_prompt_tokens > max_model_len:
        return (
            f"prompt has {request.num_prompt_tokens} tokens, more than "
            f"max_model_len={max_model_len}"
        )
    return None


class QueueFull(RuntimeError):
    """The engine holds as many prompt tokens waiting to be computed as it may: try later."""


def check_admission(
    request: Request, requests: Iterable[Request], max_queued_prompt_tokens: int
) -> None:
    """QueueFull if admitting `request` would take the prompt tokens still to be computed past
    `max_queued_prompt_tokens` (0: no bound). Requests that compute no prompt of their own are
    always admitted: a decode leg reading its prompt's KV, and a request resumed on this engine
    after another failed (refusing it would fail a stream already under way). A prompt is
    admitted when nothing waits, however long: a bound below it would refuse it forever."""
    if not max_queued_prompt_tokens or _client_has_tokens(request) or _reads_kv(request):
        return
    queued = sum(_uncomputed(other) for other in requests)
    if queued and queued + request.num_prompt_tokens > max_queued_prompt_tokens:
        raise QueueFull(
            f"the engine is at its bound of {max_queued_prompt_tokens} queued prompt tokens "
            f"({queued} waiting); retry later"
        )


def displaceable(
    request: Request, requests: Iterable[Request], max_queued_prompt_tokens: int
) -> list[Request]:
    """The waiting requests whose refusal makes room for `request`: of lower priority (the
    lowest and, among equals, the latest first), not started (nothing computed, nothing sent,
    no KV being read). [] when even all of them would not make room."""
    others = list(requests)
    queued = sum(_uncomputed(other) for other in others)
    victims: list[Request] = []
    for victim in sorted(
        (o for o in others if _displaceable_by(o, request)),
        key=lambda o: (o.priority, o.arrival_time),
        reverse=True,
    ):
        if queued + request.num_prompt_tokens <= max_queued_prompt_tokens:
            break
        victims.append(victim)
        queued -= _uncomputed(victim)
    fits = not queued or queued + request.num_prompt_tokens <= max_queued_prompt_tokens
    return victims if fits else []


def _displaceable_by(other: Request, request: Request) -> bool:
    return (
        other.priority > request.priority
        and other.status == RequestStatus.WAITING
        and not other.num_computed_tokens
        and not _client_has_tokens(other)
        and not _reads_kv(other)
    )


def _client_has_tokens(request: Request) -> bool:
    """A resumed request, or one whose first tokens another engine sent (forced here): its
    stream is under way, refusing it would break it."""
    return bool(request.output_token_ids or request.sampling_params.forced_output_token_ids)


def _reads_kv(request: Request) -> bool:
    """A decode leg reading its prompt's KV (a prefill leg reading a prefix loan computes the
    rest of its prompt: it counts)."""
    params = request.kv_transfer_params or {}
    return bool(params.get("do_remote_prefill")) and not params.get("do_remote_decode")


def _uncomputed(request: Request) -> int:
    if request.status not in (RequestStatus.WAITING, RequestStatus.RUNNING):
        return 0  # finished, or reading its KV from another engine
    if _reads_kv(request):
        return 0
    return max(0, request.num_prompt_tokens - request.num_computed_tokens)
