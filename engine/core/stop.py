"""Stop conditions checked after every appended token.

check_stop runs once per request per decode step, so it reads plain attributes (`len` of the
token lists, not the Request properties) and looks at min_tokens only for a stop token.
"""

from __future__ import annotations

from engine.request import Request, RequestStatus

_STOPPED = RequestStatus.FINISHED_STOPPED
_LENGTH_CAPPED = RequestStatus.FINISHED_LENGTH_CAPPED


def check_stop(request: Request, token_id: int, max_model_len: int) -> RequestStatus | None:
    """The finished status `token_id` (just appended) puts the request in, if any.

    EOS and stop tokens count only once `min_tokens` outputs exist; length limits always do.
    A stop token is reported as the stop reason, as in the OpenAI API's `stop_reason`.
    """
    if token_id == request.eos_token_id or token_id in request.sampling_params.stop_token_ids:
        status = _stop_token_status(request, token_id)
        if status is not None:
            return status
    if (
        len(request.output_token_ids) >= request.max_tokens
        or len(request.all_token_ids) >= max_model_len
    ):
        return _LENGTH_CAPPED
    return None


def _stop_token_status(request: Request, token_id: int) -> RequestStatus | None:
    params = request.sampling_params
    if len(request.output_token_ids) < params.min_tokens:
        return None
    if token_id == request.eos_token_id and not params.ignore_eos:
        return _STOPPED
    if token_id in params.stop_token_ids:
        request.stop_reason = token_id
        return _STOPPED
    return None


def append_until_stop(
    request: Request, token_ids: list[int], max_model_len: int
) -> tuple[int, RequestStatus | None]:
    """Append several tokens of one step (speculative decoding) up to the first that stops
    the request: how many were appended, and the finished status if one stopped it (what
    follows a stop is never appended)."""
    for n, token_id in enumerate(token_ids, 1):
        request.append_output_token_ids(token_id)
        status = check_stop(request, token_id, max_model_len)
        if status is not None:
            return n, status
    return len(token_ids), None


def reaches_length_limit(request: Request, max_model_len: int, pending: int = 0) -> bool:
    """max_tokens outputs, or a full context, counting `pending` samples not yet appended
    (async scheduling's placeholders)."""
    return (
        len(request.output_token_ids) + pending >= request.max_tokens
        or len(request.all_token_ids) + pending >= max_model_len
    )


def owes_its_last_token(request: Request, max_model_len: int) -> bool:
    """The steps in flight (async scheduling) already sample up to a length limit (max_tokens
    or the context): scheduling the request again would compute tokens nobody reads."""
    return reaches_length_limit(request, max_model_len, request.num_output_placeholders)
