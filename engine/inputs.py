"""What turns a caller's input into an engine `Request` (vLLM's input processor): the model's
configuration and tokenizer, loaded once; prompts as text, token ids or a conversation; the
chat template; request construction.

Everything that takes requests starts here — `LLM`, `AsyncEngine` (through
`EngineCore.from_inputs`) and the Serve router, which tokenizes for both legs of a request and
never holds an engine. Nothing here imports the engine core or the model runner.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.arg_utils import EngineArgs
from engine.config import EngineConfig, ModelConfig
from engine.models import ModelArchConfig
from engine.models.catalog import is_gguf_path
from engine.request import Request, SamplingParams
from engine.tokenizer import Tokenizer

PromptInput = str | Sequence[int] | dict[str, Any]
# One conversation: [{"role": "user", "content": "..."}, ...].
ChatMessages = Sequence[Mapping[str, Any]]


@dataclass(frozen=True)
class ReasoningTokens:
    """The ids of a reasoning model's <think> and </think> (None: the vocabulary has none)."""

    start: int | None = None
    end: int | None = None


class InputProcessor:
    """One model's inputs: its engine configuration, architecture and tokenizer."""

    def __init__(self, config: EngineConfig, arch: ModelArchConfig) -> None:
        self.config = config
        self.arch = arch
        self.tokenizer = load_tokenizer(config.model)
        self.max_model_len = config.scheduler.max_model_len

    @classmethod
    def from_args(cls, model: str, **engine_args: Any) -> InputProcessor:
        """From vLLM-named engine arguments (ValueError on a bad one)."""
        config, arch = EngineArgs.from_kwargs(model, **engine_args).create_engine_config()
        return cls(config, arch)

    @property
    def reasoning_tokens(self) -> ReasoningTokens:
        tokenizer = self.tokenizer
        if tokenizer is None:
            return ReasoningTokens()
        return ReasoningTokens(tokenizer.token_id("<think>"), tokenizer.token_id("</think>"))

    def encode(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt (see `encode_prompt`)."""
        return encode_prompt(self.tokenizer, prompt, self.max_model_len)

    def make_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        **request_kwargs: Any,
    ) -> Request:
        return make_request(
            request_id, prompt_token_ids, params, self.arch.eos_token_ids, **request_kwargs
        )


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
