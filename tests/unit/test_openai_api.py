"""The OpenAI request models without a server: which fields are honoured, which are refused by
name, and function calling against chat templates that do and do not render tools."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from deployments.router.openai_requests import ChatCompletionRequest, CompletionRequest
from deployments.router.openai_tools import template_kwargs, template_renders_tools
from engine.tokenizer import Tokenizer, TokenizerConfig

HI = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
PLAIN_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
# Names `tools` without writing them out: not a template that renders tools.
MENTIONS_TOOLS = "{# tools are not rendered #}{% set unused = tools %}" + PLAIN_TEMPLATE
TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>"
    "{% endif %}" + PLAIN_TEMPLATE
)


def _tokenizer(template: str) -> Tokenizer:
    return Tokenizer(HFTokenizer(BPE()), TokenizerConfig(chat_template=template))


def _chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": HI, **fields})


def _tool_kwargs(template: str, **fields: Any) -> dict[str, Any]:
    body = _chat(**fields)
    message_fields = [name for i, m in enumerate(body.messages) for name in m.tool_fields(i)]
    return template_kwargs(body, message_fields, _tokenizer(template))


def test_which_templates_render_tools() -> None:
    assert template_renders_tools(_tokenizer(TOOLS_TEMPLATE))
    assert not template_renders_tools(_tokenizer(PLAIN_TEMPLATE))
    assert not template_renders_tools(_tokenizer(MENTIONS_TOOLS))
    assert not template_renders_tools(_tokenizer("{{ raise_exception('no') }}"))


@pytest.mark.parametrize("template", [PLAIN_TEMPLATE, MENTIONS_TOOLS])
@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"tools": [TOOL]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        ({"functions": [TOOL["function"]]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"parallel_tool_calls": False}, "parallel_tool_calls"),
        (
            {
                "messages": [
                    *HI,
                    {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]},
                ]
            },
            "messages[1].tool_calls",
        ),
        (
            {"messages": [*HI, {"role": "tool", "content": "18C", "tool_call_id": "c1"}]},
            "messages[1].tool_call_id",
        ),
    ],
)
def test_function_calling_is_refused_by_a_template_without_tools(template, fields, name) -> None:
    with pytest.raises(ValueError) as excinfo:
        _tool_kwargs(template, **fields)
    assert str(excinfo.value) == f"{name} is not supported by this model's chat template"


def test_tool_choice_none_alone_asks_for_nothing() -> None:
    assert _tool_kwargs(PLAIN_TEMPLATE, tool_choice="none", function_call="none") == {}


def test_a_template_that_renders_tools_gets_them_with_tool_choice_none() -> None:
    kwargs = _tool_kwargs(TOOLS_TEMPLATE, tools=[TOOL], tool_choice="none")
    assert kwargs == {"tools": [TOOL]}
    prompt = _tokenizer(TOOLS_TEMPLATE).apply_chat_template(HI, **kwargs)
    assert prompt.startswith("<tools>get_weather;</tools>")


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"tools": [TOOL]}, "tool_choice 'auto' needs a tool-call parser"),
        ({"tools": [TOOL], "tool_choice": "required"}, "tool_choice 'required' needs a tool-call"),
        ({"functions": [TOOL["function"]]}, "deprecated by OpenAI: use tools"),
    ],
)
def test_tool_calls_wait_for_a_parser_even_where_the_template_renders_tools(fields, words) -> None:
    with pytest.raises(ValueError, match=words):
        _tool_kwargs(TOOLS_TEMPLATE, **fields)


# --- other fields ----------------------------------------------------------------------------


def test_metadata_fields_are_accepted_and_change_nothing() -> None:
    metadata = {
        "user": "u1",
        "safety_identifier": "s1",
        "metadata": {"k": "v"},
        "store": False,
        "prompt_cache_key": "p",
        "service_tier": "auto",
        "response_format": {"type": "text"},
    }
    plain = _chat(max_tokens=4).sampling_params(4, None)
    assert _chat(max_tokens=4, **metadata).sampling_params(4, None) == plain


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"stream_options": {"include_usage": True}}, "stream_options needs stream: true"),
        ({"store": True}, "store: true is not supported"),
        ({"service_tier": "flex"}, "service_tier 'flex' is not supported"),
        ({"min_tokens": 2, "guided_regex": "a+"}, "min_tokens does not combine"),
        ({"guided_decoding_backend": "outlines"}, "must be xgrammar"),
    ],
)
def test_fields_not_honoured_are_refused_by_name(fields, words) -> None:
    for request in (_chat(**fields), CompletionRequest(prompt="hi", **fields)):
        with pytest.raises(ValueError, match=words):
            request.sampling_params(4, None)


def test_structured_output_fields_map_to_params() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "a", "strict": True, "schema": schema},
    }
    got = _chat(response_format=response_format).sampling_params(4, None).structured_outputs
    assert got is not None and got.kind == "json" and got.json is not None
    assert '"a": {"type": "integer"}' in got.json
    got = _chat(guided_choice=["x", "y"]).sampling_params(4, None).structured_outputs
    assert got is not None and got.choice == ("x", "y")


def test_unknown_fields_are_refused_by_name_in_a_message_too() -> None:
    with pytest.raises(pydantic.ValidationError, match="frobnicate"):
        _chat(frobnicate=1)
    with pytest.raises(pydantic.ValidationError, match="refusal"):
        _chat(messages=[{"role": "assistant", "content": "x", "refusal": "no"}])


def test_a_message_name_reaches_the_template() -> None:
    body = _chat(messages=[{"role": "user", "content": "hi", "name": "ann"}])
    assert body.messages[0].as_template_message() == {
        "role": "user",
        "content": "hi",
        "name": "ann",
    }
    with pytest.raises(ValueError, match="a user message needs content"):
        _chat(messages=[{"role": "user"}]).messages[0].as_template_message()
