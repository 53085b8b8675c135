"""The offline API: LLM(model, **engine_args).generate(prompts, sampling_params)."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Mapping, Sequence
from typing import Any

from engine.arg_utils import EngineArgs
from engine.config import ModelConfig
from engine.engine_core import EngineCore
from engine.models.catalog import TINY_MODEL, is_gguf_path
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.request import Request, RequestStatus, SamplingParams
from engine.tokenizer import Tokenizer
from engine.worker.model_runner import ReasoningTokens

PromptInput = str | Sequence[int] | dict[str, Any]
# One conversation: [{"role": "user", "content": "..."}, ...].
ChatMessages = Sequence[Mapping[str, Any]]
KVParams = dict[str, Any]


def load_tokenizer(model: ModelConfig) -> Tokenizer | None:
    """The model's tokenizer (or the --tokenizer override). None for a model directory without
    tokenizer.json or a GGUF without tokenizer metadata: it still serves token-id prompts. A
    GGUF tokenizer or an override that cannot be built is an error."""
    if model.tokenizer is None and is_gguf_path(model.model):
        from engine.models.gguf_file import metadata, open_gguf

        if metadata(open_gguf(model.model), "tokenizer.ggml.model") is None:
            return None  # weights only; its errors are the tokenizer builder's to report
        return Tokenizer.from_pretrained(model.model)
    try:
        return Tokenizer.from_pretrained(model.tokenizer_path)
    except ValueError:
        if model.tokenizer is not None:
            raise
        return None


def reasoning_tokens(tokenizer: Tokenizer | None) -> ReasoningTokens:
    if tokenizer is None:
        return ReasoningTokens()
    return ReasoningTokens(tokenizer.token_id("<think>"), tokenizer.token_id("</think>"))


class LLM:
    def __init__(self, model: str = TINY_MODEL, **engine_args: Any) -> None:
        args = EngineArgs.from_kwargs(model, **engine_args)
        config, arch = args.create_engine_config()
        self.tokenizer = load_tokenizer(config.model)
        self.engine = EngineCore(
            config, arch, reasoning_tokens(self.tokenizer), tokenizer=self.tokenizer
        )
        self.max_model_len = config.scheduler.max_model_len
        self._counter = itertools.count()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        kv_transfer_params: KVParams | Sequence[KVParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        `kv_transfer_params` (one dict for all prompts, or one per prompt):
        {"do_remote_decode": True} makes this engine the prefill side (the output's
        kv_transfer_params say where the KV waits); a prefill output's kv_transfer_params
        make it the decode side. Needs `kv_transfer_config`.
        """
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        kv_list = _as_kv_params_list(kv_transfer_params, len(prompt_list))
        if any(kv_list) and not self.engine.supports_kv_transfer:
            raise ValueError("kv_transfer_params need LLM(..., kv_transfer_config={...})")
        processor = OutputProcessor(self.tokenizer, final_only=True)
        order = [
            self._add(processor, prompt, params, kv)
            for prompt, params, kv in zip(prompt_list, params_list, kv_list, strict=True)
        ]
        finals: dict[str, RequestOutput] = {}
        # Until our requests end; blocks held for remote readers are released by later steps.
        while len(finals) < len(order):
            results, stopped = processor.process(self.engine.step())
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
    ) -> str:
        text, token_ids = encode_prompt(self.tokenizer, prompt, self.max_model_len)
        request_id = str(next(self._counter))
        request = make_request(
            request_id,
            token_ids,
            params,
            self.engine.arch.eos_token_ids,
            kv_transfer_params=dict(kv_transfer_params) if kv_transfer_params else None,
        )
        processor.add_request(request_id, text, request.prompt_token_ids, params)
        self.engine.add_request(request)
        return request_id


def render_chat(tokenizer: Tokenizer | None, messages: ChatMessages) -> tuple[str, list[int]]:
    """(text, token ids) of a conversation rendered with the model's chat template, ready for
    the assistant's turn. The template writes its own bos, so encoding adds none."""
    if tokenizer is None:
        raise ValueError("chat prompts need a tokenizer with a chat template")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return text, tokenizer.encode(text, add_special_tokens=False)


def encode_prompt(
    tokenizer: Tokenizer | None, prompt: PromptInput, max_model_len: int
) -> tuple[str | None, list[int]]:
    """(text, token ids) of a prompt given as text, token ids, or a dict of either (or of
    chat messages: {"messages": [...]})."""
    text: str | None = None
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            prompt = list(prompt["prompt_token_ids"])
        elif "prompt" in prompt:
            prompt = prompt["prompt"]
        elif "messages" in prompt:
            text, prompt = render_chat(tokenizer, prompt["messages"])
        else:
            raise ValueError("a prompt dict needs 'prompt', 'prompt_token_ids' or 'messages'")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer; pass token ids instead")
        text, token_ids = prompt, tokenizer.encode(prompt)
    else:
        token_ids = [int(t) for t in prompt]
    if len(token_ids) > max_model_len:
        raise ValueError(
            f"prompt has {len(token_ids)} tokens, more than max_model_len={max_model_len}"
        )
    return text, token_ids


def make_request(
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    eos_token_ids: Sequence[int],
    **request_kwargs: Any,
) -> Request:
    """A Request for this model: the first EOS id is the request's EOS; further ones (Llama 3
    has two) stop generation as stop tokens, unless EOS is ignored."""
    extra = [t for t in eos_token_ids[1:] if t not in params.stop_token_ids]
    if extra and not params.ignore_eos:
        params = dataclasses.replace(params, stop_token_ids=(*params.stop_token_ids, *extra))
    eos = eos_token_ids[0] if eos_token_ids else None
    return Request(request_id, prompt_token_ids, params, eos_token_id=eos, **request_kwargs)


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
