"""The router's checks of a prompt: tokenized once, refused (ValueError) before any engine sees
what it would refuse."""

from __future__ import annotations

from deployments.protocol import ChatPrompt
from engine.inputs import render_chat
from engine.tokenizer import Tokenizer


def tokenize_prompt(
    tokenizer: Tokenizer | None, vocab_size: int, prompt: str | list[int] | ChatPrompt
) -> tuple[str | None, list[int]]:
    """(text, token ids) of a text, token-id or chat prompt; ValueError for an empty one,
    text without a tokenizer, or ids outside the vocabulary."""
    if isinstance(prompt, ChatPrompt):
        if not prompt.messages:
            raise ValueError("chat has no messages")
        return render_chat(tokenizer, prompt.messages)
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: send token ids")
        return prompt, tokenizer.encode(prompt)
    if not prompt:
        raise ValueError("prompt is empty: token_ids has no ids")
    bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    return None, list(prompt)


def context_max_tokens(max_model_len: int, num_prompt_tokens: int) -> int:
    """An answer's length when the request set none (OpenAI's chat completions): as many
    tokens as the context leaves after the prompt (at least one: a prompt that fills the
    context is then refused by `check_length`, with its numbers)."""
    return max(1, max_model_len - num_prompt_tokens)


def check_length(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """Refuse, never cut: a request whose output could not fit in the context (vLLM's
    behaviour) is an error saying how many tokens remain."""
    remaining = max_model_len - num_prompt_tokens
    if remaining <= 0:
        raise ValueError(
            f"prompt has {num_prompt_tokens} tokens; max_model_len={max_model_len} "
            "leaves no room for output"
        )
    if max_tokens > remaining:
        raise ValueError(
            f"max_tokens={max_tokens} does not fit: this model's context is "
            f"max_model_len={max_model_len} tokens and the prompt has {num_prompt_tokens}, "
            f"so at most {remaining} output tokens remain"
        )
