"""OpenAI function calling at the chat edge: today, refused by name; the hook for tool calls.

Serving tools takes two halves. The prompt half: the model's chat template renders the tool
definitions (and earlier turns' `tool_calls` / `tool` messages). The reply half: a tool-call
parser turns the model's text into `tool_calls` (vLLM's `--tool-call-parser`; it would sit in
`openai_format.ChatFormat`, and `tool_choice: "required"` or a named function could be held to
the function's parameters schema with structured outputs). Neither is here yet, so:

- a template that does not render tools: every function-calling field is a 400 "... is not
  supported by this model's chat template" (our models' templates are such);
- a template that does: the tools reach the template only with `tool_choice: "none"` (the
  model sees them and answers in text, which is what "none" asks); any other choice is a 400
  until a tool-call parser exists — `template_kwargs` is where it would be wired in.

`tool_choice: "none"` / `function_call: "none"` without tools are accepted: they ask for nothing.
"""

from __future__ import annotations

from typing import Any, Protocol

# A tool whose name cannot occur by chance in a rendered prompt.
_PROBE_NAME = "pdserve_probe_tool_5f3a"
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": _PROBE_NAME,
        "description": "probe",
        "parameters": {"type": "object", "properties": {}},
    },
}


class _Template(Protocol):
    def apply_chat_template(
        self, messages: Any, add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str: ...


class ToolRequest(Protocol):
    """The chat request fields this module reads (openai_requests.ChatCompletionRequest)."""

    tools: list[dict[str, Any]] | None
    tool_choice: str | dict[str, Any] | None
    functions: list[dict[str, Any]] | None
    function_call: str | dict[str, Any] | None
    parallel_tool_calls: bool | None


def template_renders_tools(tokenizer: _Template) -> bool:
    """Whether the chat template writes a tool definition into the prompt (rendered, not read:
    a template that names `tools` in a comment only does not count)."""
    messages = [{"role": "user", "content": "hi"}]
    try:
        text = tokenizer.apply_chat_template(messages, tools=[_PROBE_TOOL])
    except ValueError:
        return False
    return _PROBE_NAME in text


def template_kwargs(
    request: ToolRequest, message_fields: list[str], tokenizer: _Template
) -> dict[str, Any]:
    """The chat template's variables for the request's tools ({} without any); ValueError
    naming the first field this server cannot honour. `message_fields` names the tool fields
    that the messages carry (`messages[2].tool_calls`, ...)."""
    used = _tool_fields(request) + message_fields
    if not used:
        return {}
    if not template_renders_tools(tokenizer):
        raise ValueError(f"{used[0]} is not supported by this model's chat template")
    if request.functions is not None or request.function_call not in (None, "none"):
        raise ValueError("functions / function_call are deprecated by OpenAI: use tools")
    # OpenAI's default: "auto" when the request has tools, else "none".
    choice = request.tool_choice or ("auto" if request.tools else "none")
    if choice != "none":
        # HOOK(tool calls): with a tool-call parser, "auto" / "required" / a named function
        # would be served here, and the reply's text parsed into `tool_calls`.
        raise ValueError(
            f"tool_choice {choice!r} needs a tool-call parser, which this server does not "
            'have yet; tool_choice "none" renders the tools and answers in text'
        )
    return {"tools": request.tools} if request.tools else {}


def _tool_fields(request: ToolRequest) -> list[str]:
    used = [
        name
        for name in ("tools", "functions", "parallel_tool_calls")
        if getattr(request, name) is not None
    ]
    used += [
        name
        for name in ("tool_choice", "function_call")
        if getattr(request, name) not in (None, "none")
    ]
    return used
