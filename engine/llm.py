"""The offline API: LLM(model, **engine_args).generate(prompts, sampling_params)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Union

from engine.arg_utils import EngineArgs
from engine.engine_core import EngineCore
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.request import Request, RequestStatus, SamplingParams
from engine.tokenizer import Tokenizer
from engine.worker.model_runner import ReasoningTokens

PromptInput = Union[str, Sequence[int], dict[str, Any]]


def load_tokenizer(model_path: str) -> Tokenizer | None:
    try:
        return Tokenizer.from_pretrained(model_path)
    except ValueError:
        return None  # a model without tokenizer.json still serves token-id prompts


def reasoning_tokens(tokenizer: Tokenizer | None) -> ReasoningTokens:
    if tokenizer is None:
        return ReasoningTokens()
    return ReasoningTokens(tokenizer.token_id("<think>"), tokenizer.token_id("</think>"))


class LLM:
    def __init__(self, model: str = "default", **engine_args: Any) -> None:
        args = EngineArgs.from_kwargs(model, **engine_args)
        config, arch = args.create_engine_config()
        self.tokenizer = load_tokenizer(config.model.model)
        self.engine = EngineCore(config, arch, reasoning_tokens(self.tokenizer))
        self.max_model_len = config.scheduler.max_model_len
        self._counter = itertools.count()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        processor = OutputProcessor(self.tokenizer)
        order: list[str] = []
        for prompt, params in zip(prompt_list, params_list, strict=True):
            order.append(self._add(processor, prompt, params))
        finals: dict[str, RequestOutput] = {}
        while self.engine.has_requests():
            results, stopped = processor.process(self.engine.step())
            if stopped:
                self.engine.abort_requests(stopped, RequestStatus.FINISHED_STOPPED)
            finals.update((r.request_id, r) for r in results if r.finished)
        return [finals[request_id] for request_id in order]

    def _add(self, processor: OutputProcessor, prompt: PromptInput, params: SamplingParams) -> str:
        text, token_ids = self.encode_prompt(prompt)
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens, more than "
                f"max_model_len={self.max_model_len}"
            )
        request_id = str(next(self._counter))
        eos = self.engine.arch.eos_token_id
        request = Request(request_id, token_ids, params, eos_token_id=eos)
        processor.add_request(request_id, text, request.prompt_token_ids, params)
        self.engine.add_request(request)
        return request_id

    def encode_prompt(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids instead")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return None, list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.encode_prompt(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        return None, list(prompt)


def _as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    items = list(prompts)
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
