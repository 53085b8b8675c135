"""The text side of a request: engine outputs (token ids) in, client chunks (text) out.

One detokenizer and the stop strings per request, over the tokens of both legs of a
disaggregated request, so its text is exactly the colocated text; plus usage and timing.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from deployments.errors import EngineFailure
from deployments.protocol import ResponseChunk, Usage
from deployments.router.text_work import TextWork
from engine.output_processor import OutputProcessor
from engine.outputs import EngineCoreOutput, RequestOutput, TokenLogprobs
from engine.pin_request import PinRequest
from engine.request import SamplingParams
from engine.tokenizer import Tokenizer


@dataclass
class PreparedRequest:
    """A validated, tokenized request on its way through the flow."""

    request_id: str
    engine_request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams  # what the client asked, with a seed when sampling disaggregated
    priority: int
    cache_salt: str | None
    started: float
    deadline: float
    trace_context: dict[str, str] | None = None
    pin: PinRequest | None = None
    # The cluster index's holdings for the prompt, once the Router's survey has them (every
    # leg's request router ranks by them: EngineRequest.routing_holdings).
    holdings: Mapping[str, Any] | None = None


# Stop strings longer than this together make each chunk's text work (searching the new text for
# every one of them) worth a worker thread; below it a thread hop costs more than it saves.
INLINE_STOP_CHARS = 4096


class ResponseStream:
    """Engine outputs -> client chunks: detokenization, stop strings, usage and timing."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        prepared: PreparedRequest,
        text_work: TextWork,
    ) -> None:
        self.prepared = prepared
        self.processor = OutputProcessor(tokenizer)
        # Keyed by the engine request id: both legs' outputs carry it.
        self.processor.add_request(
            prepared.engine_request_id,
            prepared.prompt,
            prepared.prompt_token_ids,
            prepared.params,
        )
        self.route = ""
        self.num_cached_tokens = 0
        # What the generating engine did with the turn's KV pin (its last output's timing).
        self.pinned_ttl_s = 0.0
        self.pin_refused = False
        self.finished = False
        self._ttft_s = 0.0
        self._sent_first = False
        self.offload = sum(len(stop) for stop in prepared.params.stop) > INLINE_STOP_CHARS
        self._text_work = text_work

    async def feed_async(
        self, output: EngineCoreOutput, leg: str, final: bool = True
    ) -> list[ResponseChunk]:
        """`feed`, in a worker thread when this request's text work is heavy (many or long
        stop strings), so that one request cannot stall the event loop the others share."""
        if self.offload:
            return await self._text_work.offload(self.feed, output, leg, final)
        return self.feed(output, leg, final)

    def feed(self, output: EngineCoreOutput, leg: str, final: bool = True) -> list[ResponseChunk]:
        """The client chunk (at most one) for one output of the `leg` engine ("prefill",
        "decode", "colocated"). `final=False` keeps a finish reason of the engine (the prefill
        leg's max_tokens=1) from ending the request."""
        if output.request_id != self.prepared.engine_request_id:
            raise RuntimeError(
                f"the {leg} engine answered for request {output.request_id!r}, "
                f"not {self.prepared.engine_request_id!r}"
            )
        if output.error is not None:
            raise EngineFailure(f"the {leg} engine failed: {output.error}")
        if not final and output.finish_reason is not None:
            output = dataclasses.replace(output, finish_reason=None, stop_reason=None)
        if output.timing is not None:  # an engine's last output: what came of its pin
            self.pinned_ttl_s = output.timing.pin_ttl_s or 0.0
            self.pin_refused = output.timing.pin_refused
        if not output.new_token_ids and output.finish_reason is None:
            return []  # nothing new (the decode leg's repeat of the first token, dropped)
        # The processor ends a request at the token that completed a stop string, even when
        # the engine sent several tokens in one output.
        results, _stopped = self.processor.process([output])
        if not results:
            return []
        result = results[0]
        completion = result.outputs[0]
        return [
            self._client_chunk(
                result,
                list(completion.new_token_ids),
                completion.delta_text,
                completion.new_logprobs or None,
            )
        ]

    def _client_chunk(
        self,
        result: RequestOutput,
        token_ids: list[int],
        text: str,
        logprobs: list[TokenLogprobs] | None,
    ) -> ResponseChunk:
        completion = result.outputs[0]
        now = time.monotonic() - self.prepared.started
        chunk = ResponseChunk(
            request_id=self.prepared.request_id,
            token_ids=token_ids,
            text=text,
            route=self.route,
            logprobs=logprobs,
        )
        if not self._sent_first:
            self._sent_first = True
            self._ttft_s = now
            chunk.prompt_token_ids = self.prepared.prompt_token_ids
        chunk.ttft_s = self._ttft_s
        if result.finished:
            self.finished = True
            chunk.finish_reason = completion.finish_reason
            chunk.e2e_s = now
            chunk.usage = Usage(
                prompt_tokens=len(self.prepared.prompt_token_ids),
                completion_tokens=len(completion.token_ids),
                cached_tokens=self.num_cached_tokens,
                pinned_ttl_s=self.pinned_ttl_s,
                pin_refused=self.pin_refused,
            )
        return chunk
