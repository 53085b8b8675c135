"""Stop conditions checked after every appended token."""

from __future__ import annotations

from engine.request import Request, RequestStatus

_STOPPED = RequestStatus.FINISHED_STOPPED
_LENGTH_CAPPED = RequestStatus.FINISHED_LENGTH_CAPPED


def check_stop(request: Request, token_id: int, max_model_len: int) -> RequestStatus | None:
    """The finished status `token_id` (just appended) puts the request in, if any.

    EOS and stop tokens count only once `min_tokens` outputs exist; length limits always do.
    A stop token is reported as the stop reason, as in the OpenAI API's `stop_reason`.
    """
    params = request.sampling_params
    num_output_tokens = len(request.output_token_ids)
    if num_output_tokens >= params.min_tokens:
        if token_id == request.eos_token_id and not params.ignore_eos:
            return _STOPPED
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return _STOPPED
    if reaches_length_limit(request, max_model_len):
        return _LENGTH_CAPPED
    return None


def reaches_length_limit(request: Request, max_model_len: int, pending: int = 0) -> bool:
    """max_tokens outputs, or a full context, counting `pending` samples not yet appended
    (async scheduling's placeholders)."""
    return (
        request.num_output_tokens + pending >= request.max_tokens
        or request.num_tokens + pending >= max_model_len
    )
