"""The text side of a request: engine chunks (tokens) in, client chunks (text) out.

One detokenizer and the stop strings per request, over the tokens of both legs of a
disaggregated request, so its text is exactly the colocated text; plus usage and timing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from deployments.engine_server import EngineChunk
from deployments.protocol import ResponseChunk, Usage
from engine.core.sched_output import EngineCoreOutput
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.request import FinishReason, SamplingParams
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


class ResponseStream:
    """Engine chunks -> client chunks: detokenization, stop strings, usage and timing."""

    def __init__(self, tokenizer: Tokenizer | None, prepared: PreparedRequest) -> None:
        self.prepared = prepared
        self.processor = OutputProcessor(tokenizer)
        self.processor.add_request(
            prepared.request_id, prepared.prompt, prepared.prompt_token_ids, prepared.params
        )
        self.route = ""
        self.num_cached_tokens = 0
        self.finished = False
        self._ttft_s = 0.0
        self._sent_first = False

    def feed(self, engine_chunk: EngineChunk, final: bool = True) -> list[ResponseChunk]:
        """The client chunk (at most one) for one engine chunk. `final=False` keeps a finish
        reason of the engine (the prefill leg's max_tokens=1) from ending the request."""
        if engine_chunk.error is not None:
            raise RuntimeError(f"engine error: {engine_chunk.error}")
        finish = engine_chunk.finish_reason if final else None
        if not engine_chunk.new_token_ids and finish is None:
            return []  # nothing new (the decode leg's repeat of the first token, dropped)
        token_ids: list[int] = []
        text: list[str] = []
        logprobs: list[Any] = []
        last: RequestOutput | None = None
        # Token by token, as the engine made them: a stop string ends the request at the
        # token that completed it even when the engine sent several tokens in one chunk.
        for output in self._per_token(engine_chunk, finish):
            results, _stopped = self.processor.process([output])
            for result in results:  # read now: the processor reuses its CompletionOutput
                completion = result.outputs[0]
                token_ids.extend(completion.new_token_ids)
                text.append(completion.delta_text)
                logprobs.extend(completion.new_logprobs or ())
                last = result
            if last is not None and last.finished:
                break
        if last is None:
            return []
        return [self._client_chunk(last, token_ids, "".join(text), logprobs or None)]

    def _per_token(self, chunk: EngineChunk, finish: str | None) -> list[EngineCoreOutput]:
        ids, logprobs = chunk.new_token_ids, chunk.new_logprobs
        outputs = [
            EngineCoreOutput(
                request_id=self.prepared.request_id,
                new_token_ids=[token_id],
                new_logprobs=[logprobs[i]] if logprobs else None,
            )
            for i, token_id in enumerate(ids)
        ] or [EngineCoreOutput(request_id=self.prepared.request_id, new_token_ids=[])]
        if finish:
            outputs[-1].finish_reason = FinishReason(finish)
            outputs[-1].stop_reason = chunk.stop_reason
        return outputs

    def _client_chunk(
        self, result: RequestOutput, token_ids: list[int], text: str, logprobs: list[Any] | None
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
            )
        return chunk
