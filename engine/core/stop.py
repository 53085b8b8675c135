"""Stop conditions checked after every appended token.

append_sampled runs once per request per decode step, so it reads plain attributes (a set of
the tokens that may stop the request, the token count at which max_tokens is reached) and
looks at min_tokens only for a stop token.
"""

from __future__ import annotations

from engine.request import Request, RequestStatus

_STOPPED = RequestStatus.FINISHED_STOPPED
_LENGTH_CAPPED = RequestStatus.FINISHED_LENGTH_CAPPED


def append_sampled(request: Request, token_id: int, max_model_len: int) -> RequestStatus | None:
    """Append a sampled token; the finished status it puts the request in, if any.

    EOS and stop tokens count only once `min_tokens` outputs exist; length limits always do.
    A stop token is reported as the stop reason, as in the OpenAI API's `stop_reason`.
    """
    num_tokens = request.append_output_token_ids(token_id)
    if token_id in request.stop_token_set:
        stops, reason = _stop_of(request, token_id, len(request.output_token_ids))
        if stops:
            if reason is not None:
                request.stop_reason = reason
            return _STOPPED
    if num_tokens >= request.max_num_tokens or num_tokens >= max_model_len:
        return _LENGTH_CAPPED
    return None


def _stop_of(request: Request, token_id: int, num_outputs: int) -> tuple[bool, int | None]:
    """Whether a stop token as output number `num_outputs` stops the request, and its stop
    reason (None for EOS)."""
    params = request.sampling_params
    if num_outputs < params.min_tokens:
        return False, None
    if token_id == request.eos_token_id and not params.ignore_eos:
        return True, None
    if token_id in params.stop_token_ids:
        return True, token_id
    return False, None


def append_until_stop(
    request: Request, token_ids: list[int], max_model_len: int
) -> tuple[int, RequestStatus | None]:
    """Append several tokens of one step (speculative decoding) up to the first that stops
    the request: how many were appended, and the finished status if one stopped it (what
    follows a stop is never appended)."""
    for n, token_id in enumerate(token_ids, 1):
        status = append_sampled(request, token_id, max_model_len)
        if status is not None:
            return n, status
    return len(token_ids), None


def adoptable_first_token(request: Request, max_model_len: int) -> int | None:
    """The first output token another engine sampled and sent with the prompt's KV (forced
    here), if this engine may take it as sampled rather than compute the last prompt token
    again for it; None where it may not.

    Computing that token again as a one-row step attends as a decode does, where the
    prefill's chunk attended through SDPA: other last bits (unless every token attends as a
    decode: `batch_invariant`). Adopting the token with the whole prompt's KV leaves this
    engine where a colocated one stands after its prefill, whatever the attention path, and
    saves it a step. Not where that row is needed after all: for the token's logprobs, or to
    end the request (a stop token, a length limit) as the step would.
    """
    params = request.sampling_params
    forced = params.forced_output_token_ids
    if not forced or request.output_token_ids or request.num_output_placeholders:
        return None
    if params.logprobs is not None or _stop_of(request, forced[0], 1)[0]:
        return None
    num_tokens = len(request.all_token_ids) + 1
    if num_tokens >= request.max_num_tokens or num_tokens >= max_model_len:
        return None
    return forced[0]


def reaches_length_limit(request: Request, max_model_len: int, pending: int = 0) -> bool:
    """max_tokens outputs, or a full context, counting `pending` samples not yet appended
    (async scheduling's placeholders)."""
    num_tokens = len(request.all_token_ids) + pending
    return num_tokens >= request.max_num_tokens or num_tokens >= max_model_len


def owes_its_last_token(request: Request, max_model_len: int) -> bool:
    """The steps in flight (async scheduling) already sample up to a length limit (max_tokens
    or the context): scheduling the request again would compute tokens nobody reads."""
    return reaches_length_limit(request, max_model_len, request.num_output_placeholders)
