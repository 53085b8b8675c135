"""Turns EngineCoreOutputs into RequestOutputs: detokenizes and applies stop strings.

The one place token ids become text: `LLM.generate`, `AsyncEngine.generate` and the router's
ResponseStream all use it, so a request reads the same whichever way it was served.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.outputs import CompletionOutput, EngineCoreOutput, RequestOutput
from engine.request import SamplingParams
from engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class _RequestState:
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    completion: CompletionOutput
    # Detokenize once at the end: nobody reads the text before, and no stop string needs it.
    deferred: bool = False


class OutputProcessor:
    """`final_only`: the caller wants each request's finished output and nothing before it
    (offline `LLM.generate`). Then `process` returns only finished outputs, and a request
    without stop strings is detokenized once when it ends instead of at every step (two
    tokenizer calls per request and step: ~10% of a decode step of the default model)."""

    def __init__(self, tokenizer: Tokenizer | None, final_only: bool = False) -> None:
        self.tokenizer = tokenizer
        self.final_only = final_only
        self._states: dict[str, _RequestState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none")
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
        completion = CompletionOutput(index=0, text="", token_ids=[])
        if params.logprobs is not None:
            completion.logprobs = []
        self._states[request_id] = _RequestState(
            prompt,
            prompt_token_ids,
            params,
            detokenizer,
            completion,
            deferred=self.final_only and not params.stop,
        )

    def num_requests(self) -> int:
        return len(self._states)

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """RequestOutputs for this step, and the ids that matched a stop string (the caller
        finishes them in the engine: the engine only knows tokens)."""
        results: list[RequestOutput] = []
        stopped_by_string: list[str] = []
        for output in outputs:
            state = self._states.get(output.request_id)
            if state is None:
                continue  # aborted by the caller meanwhile
            if self._apply_exactly(state, output):
                stopped_by_string.append(output.request_id)
            finished = state.completion.finish_reason is not None
            if finished or not self.final_only:
                results.append(self._request_output(output, state, finished))
            if finished:
                del self._states[output.request_id]
        return results, stopped_by_string

    def abort(self, request_id: str) -> RequestOutput | None:
        """Drop a request; its last RequestOutput says it was aborted."""
        state = self._states.pop(request_id, None)
        if state is None:
            return None
        state.completion.finish_reason = "abort"
        state.completion.delta_text, state.completion.new_token_ids = "", []
        return RequestOutput(
            request_id, state.prompt, state.prompt_token_ids, [state.completion], finished=True
        )

    def _apply_exactly(self, state: _RequestState, output: EngineCoreOutput) -> bool:
        """`_apply`, token by token when a stop string may end the request inside `output`
        (several tokens of one step, or of coalesced steps): the request then ends at the
        token that completed the string, and what followed it is never reported."""
        ids = output.new_token_ids
        if len(ids) <= 1 or not state.params.stop or state.deferred:
            return self._apply(state, output)
        completion = state.completion
        new_token_ids: list[int] = []
        delta_text: list[str] = []
        stopped_by_string = False
        for i, token_id in enumerate(ids):
            last = i == len(ids) - 1
            piece = EngineCoreOutput(
                output.request_id,
                [token_id],
                output.finish_reason if last else None,
                output.stop_reason if last else None,
                new_logprobs=[output.new_logprobs[i]] if output.new_logprobs else None,
            )
            stopped_by_string = self._apply(state, piece)
            new_token_ids.append(token_id)
            delta_text.append(completion.delta_text)
            if completion.finish_reason is not None:
                break
        completion.new_token_ids = new_token_ids
        completion.delta_text = "".join(delta_text)
        # A string found before the output's own end stops a request the engine may already
        # have finished (its last token ended it): only a live request needs ending.
        return stopped_by_string and output.finish_reason is None

    def _apply(self, state: _RequestState, output: EngineCoreOutput) -> bool:
        completion = state.completion
        completion.token_ids.extend(output.new_token_ids)
        completion.new_token_ids = list(output.new_token_ids)
        if completion.logprobs is not None and output.new_logprobs:
            completion.logprobs.extend(output.new_logprobs)
        stopped_by_string = False
        if state.deferred:
            if output.finish_reason is not None:
                # The whole completion is this output's delta: the caller saw nothing before.
                completion.new_token_ids = list(completion.token_ids)
                if state.detokenizer is not None:
                    text = state.detokenizer.update(completion.token_ids, finished=True)
                    completion.text = completion.delta_text = text
        elif state.detokenizer is not None:
            was_stopped = state.detokenizer.stop_reason is not None
            # `finished` releases text held back as a possible stop-string start.
            completion.delta_text = state.detokenizer.update(
                output.new_token_ids, finished=output.finish_reason is not None
            )
            completion.text = state.detokenizer.output_text
            if state.detokenizer.stop_reason is not None and not was_stopped:
                stopped_by_string = output.finish_reason is None
                completion.finish_reason = "stop"
                completion.stop_reason = state.detokenizer.stop_reason
        if output.finish_reason is not None and completion.finish_reason is None:
            completion.finish_reason = output.finish_reason.value
            completion.stop_reason = output.stop_reason
        return stopped_by_string

    @staticmethod
    def _request_output(
        output: EngineCoreOutput, state: _RequestState, finished: bool
    ) -> RequestOutput:
        return RequestOutput(
            request_id=output.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[state.completion],
            finished=finished,
            kv_transfer_params=output.kv_transfer_params,
            num_cached_tokens=output.num_cached_tokens,
            error=output.error,
            timing=output.timing,
        )
