"""The offline API: LLM(model, **engine_args).generate(prompts, sampling_params)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from typing import Any

from engine.engine_core import EngineCore
from engine.inputs import ChatMessages, InputProcessor, PromptInput
from engine.models.catalog import TINY_MODEL
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.pin_request import PinRequest
from engine.request import RequestStatus, SamplingParams
from engine.tokenizer import Tokenizer

KVParams = dict[str, Any]


class LLM:
    def __init__(self, model: str = TINY_MODEL, **engine_args: Any) -> None:
        self.inputs = InputProcessor.from_args(model, **engine_args)
        self.engine = EngineCore.from_inputs(self.inputs)
        self._counter = itertools.count()

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.inputs.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        kv_transfer_params: KVParams | Sequence[KVParams] | None = None,
        pins: Sequence[PinRequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        `kv_transfer_params` (one dict for all prompts, or one per prompt):
        {"do_remote_decode": True} makes this engine the prefill side (the output's
        kv_transfer_params say where the KV waits); a prefill output's kv_transfer_params
        make it the decode side. Needs `kv_transfer_config`. `pins` (one per prompt): keep a
        finished prompt's KV for its session's next turn (engine/core/pins.py).
        """
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        kv_list = _as_kv_params_list(kv_transfer_params, len(prompt_list))
        if any(kv_list) and not self.engine.supports_kv_transfer:
            raise ValueError("kv_transfer_params need LLM(..., kv_transfer_config={...})")
        processor = OutputProcessor(self.tokenizer, final_only=True)
        pin_list = list(pins) if pins is not None else [None] * len(prompt_list)
        if len(pin_list) != len(prompt_list):
            raise ValueError(f"pins must have one entry per prompt ({len(prompt_list)})")
        order = [
            self._add(processor, prompt, params, kv, pin)
            for prompt, params, kv, pin in zip(
                prompt_list, params_list, kv_list, pin_list, strict=True
            )
        ]
        finals: dict[str, RequestOutput] = {}
        # Until our requests end; blocks held for remote readers are released by later steps.
        while len(finals) < len(order):
            results, stopped = processor.process(self.engine.step().outputs)
            if stopped:
                self.engine.abort_requests(stopped, RequestStatus.FINISHED_STOPPED)
            finals.update((r.request_id, r) for r in results if r.finished)
        if not self.engine.has_unfinished_requests():
            if self.engine.step_in_flight:
                self.engine.step()  # settle the step scheduled ahead (async scheduling)
            self.engine.step()  # let the worker drop the finished requests' state now
        return [finals[request_id] for request_id in order]

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of {role, content} dicts) or several, each rendered
        with the model's chat template (vLLM's LLM.chat)."""
        if messages and isinstance(messages[0], Mapping):
            conversations: Sequence[ChatMessages] = [messages]  # type: ignore[list-item]
        else:
            conversations = messages  # type: ignore[assignment]
        return self.generate([{"messages": c} for c in conversations], sampling_params)

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Step until nothing is pending (held blocks released, reads ended). True if idle."""
        deadline = time.monotonic() + timeout_s
        while self.engine.has_requests():
            if time.monotonic() > deadline:
                return False
            self.engine.step()
        return True

    def close(self) -> None:
        """Stop serving the side channel (a prefill-side engine serves it until then)."""
        self.engine.close()

    def _add(
        self,
        processor: OutputProcessor,
        prompt: PromptInput,
        params: SamplingParams,
        kv_transfer_params: KVParams | None,
        pin: PinRequest | None = None,
    ) -> str:
        text, token_ids = self.inputs.encode(prompt)
        request_id = str(next(self._counter))
        request = self.inputs.make_request(
            request_id,
            token_ids,
            params,
            kv_transfer_params=dict(kv_transfer_params) if kv_transfer_params else None,
            pin=pin,
        )
        processor.add_request(request_id, text, request.prompt_token_ids, params)
        self.engine.add_request(request)
        return request_id


def _as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    items: list[Any] = list(prompts)
    if not items:
        raise ValueError("no prompts given")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in items):
        return [items]  # one prompt given as token ids
    return items


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params_list = list(params)
    if len(params_list) != n:
        raise ValueError(f"{len(params_list)} sampling params for {n} prompts")
    return params_list


def _as_kv_params_list(
    params: KVParams | Sequence[KVParams] | None, n: int
) -> list[KVParams | None]:
    if params is None:
        return [None] * n
    if isinstance(params, dict):
        return [params] * n
    params_list: list[KVParams | None] = list(params)
    if len(params_list) != n:
        raise ValueError(f"{len(params_list)} kv_transfer_params for {n} prompts")
    return params_list
