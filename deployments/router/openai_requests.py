"""The OpenAI request bodies (/v1/completions, /v1/chat/completions) as pydantic models: every
field named, unknown ones refused, each one turned into SamplingParams or refused by name
(openai_api.py says which fields do what)."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from deployments.router.openai_pins import kv_pin, ttl_seconds
from engine.pin_request import PinRequest
from engine.request import SamplingParams, StructuredOutputsParams


class _StreamOptions(BaseModel):
    include_usage: bool = False


_MAX_LOGPROBS = 20  # OpenAI's cap on top_logprobs
_STRUCTURED_FIELDS = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints (OpenAI's, plus vLLM's extensions)."""

    model_config = ConfigDict(extra="forbid")  # an unknown field is a 400 that names it

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    stream: bool = False
    stream_options: _StreamOptions | None = None
    priority: int = 0
    cache_salt: str | None = None
    timeout_s: float | None = Field(default=None, gt=0)
    return_token_ids: bool = False
    # Structured outputs: OpenAI's response_format, or one of vLLM's guided_* fields.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    # Accepted, no effect on the output (see the module docstring).
    user: str | None = None
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    prompt_cache_key: str | None = None
    # Refused unless harmless (see refuse_unsupported).
    service_tier: str | None = None

    def refuse_unsupported(self) -> None:
        """ValueError naming a field this server would otherwise have to ignore."""
        if self.n != 1:
            raise ValueError(f"n must be 1 (one completion per request), got {self.n}")
        if self.store:
            raise ValueError("store: true is not supported (nothing is stored)")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options needs stream: true")
        if self.service_tier not in (None, "auto", "default"):
            raise ValueError(f"service_tier {self.service_tier!r} is not supported")
        if self.guided_decoding_backend not in (None, "auto", "xgrammar"):
            raise ValueError("guided_decoding_backend must be xgrammar (the only one here)")

    def structured_outputs(self) -> StructuredOutputsParams | None:
        given = {
            name: value for name in _STRUCTURED_FIELDS if (value := getattr(self, name)) is not None
        }
        fmt = given.get("response_format")
        if fmt is not None and fmt.get("type") == "text":
            del given["response_format"]  # plain text: no constraint
        if len(given) > 1:
            raise ValueError(f"give one structured output field, got {sorted(given)}")
        if not given:
            return None
        ((name, value),) = given.items()
        if name == "response_format":
            return _response_format(value)
        if name == "guided_json":
            return StructuredOutputsParams(json=_schema_text(value))
        if name == "guided_choice":
            return StructuredOutputsParams(choice=tuple(value))
        return StructuredOutputsParams(**{name.removeprefix("guided_"): value})

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        self.refuse_unsupported()
        if logprobs is not None and logprobs > _MAX_LOGPROBS:
            raise ValueError(f"at most {_MAX_LOGPROBS} logprobs per token, got {logprobs}")
        kwargs: dict[str, Any] = {
            name: value
            for name in (
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "seed",
                "presence_penalty",
                "frequency_penalty",
                "repetition_penalty",
            )
            if (value := getattr(self, name)) is not None
        }
        if max_tokens is not None:
            kwargs["max_tokens"] = max_tokens
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        return SamplingParams(
            **kwargs,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            logit_bias=_logit_bias(self.logit_bias),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=self.structured_outputs(),
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported (no fill-in-the-middle)")
        if self.best_of not in (None, 1):
            raise ValueError(f"best_of must be 1, got {self.best_of}")


class _ContentPart(BaseModel):
    type: str
    text: str = ""
    cache_control: dict[str, Any] | None = None  # keep the turn's KV (openai_pins.py)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: str
    content: str | list[_ContentPart] | None = None  # None: an assistant turn of tool calls
    name: str | None = None
    # Function calling (openai_tools.py decides whether the template can take them).
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    cache_control: dict[str, Any] | None = None  # keep the turn's KV (openai_pins.py)

    def pin_ttls(self, index: int) -> list[float]:
        """The TTLs its cache_control fields ask for (the message's and its parts')."""
        where = f"messages[{index}]"
        ttls = [] if self.cache_control is None else [ttl_seconds(self.cache_control, where)]
        if isinstance(self.content, list):
            ttls += [
                ttl_seconds(part.cache_control, f"{where}.content[{j}]")
                for j, part in enumerate(self.content)
                if part.cache_control is not None
            ]
        return ttls

    def as_template_message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self._text()}
        for name in ("name", "tool_calls", "tool_call_id"):
            if (value := getattr(self, name)) is not None:
                message[name] = value
        return message

    def tool_fields(self, index: int) -> list[str]:
        return [
            f"messages[{index}].{name}"
            for name in ("tool_calls", "tool_call_id")
            if getattr(self, name) is not None
        ]

    def _text(self) -> str:
        if self.content is None and self.tool_calls is None:
            raise ValueError(f"a {self.role} message needs content")
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        kinds = {part.type for part in self.content} - {"text"}
        if kinds:
            raise ValueError(f"only text content is supported, got {sorted(kinds)}")
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # Function calling: see openai_tools.py (refused unless the chat template renders tools).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # Other modalities and features this server does not have: refused when set.
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    web_search_options: dict[str, Any] | None = None

    def kv_pin(self, messages: list[dict[str, Any]]) -> PinRequest | None:
        ttls = [ttl for i, m in enumerate(self.messages) for ttl in m.pin_ttls(i)]
        return kv_pin(self.prompt_cache_key, ttls, messages)

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= _MAX_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {_MAX_LOGPROBS}]")
        if self.modalities not in (None, ["text"]):
            raise ValueError(f"only text output is supported, got modalities={self.modalities}")
        for name in ("audio", "prediction", "reasoning_effort", "web_search_options"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name} is not supported")


def _response_format(value: dict[str, Any]) -> StructuredOutputsParams:
    kind = value.get("type")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ValueError("response_format json_schema needs json_schema.schema")
        return StructuredOutputsParams(json=_schema_text(spec["schema"]))
    raise ValueError(f"response_format type must be text, json_object or json_schema, got {kind!r}")


def _schema_text(schema: dict[str, Any] | str) -> str:
    if isinstance(schema, str):
        return schema
    return json.dumps(schema)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise ValueError("logit_bias keys must be token ids") from None
