"""Router work whose cost grows with a request's text, kept off the event loop when it is large.

Rendering and tokenizing a prompt, matching a long stop list, assembling and serializing a
whole response: small amounts run inline (a thread hop costs more, and a small request then
never waits for a worker thread behind heavy ones); large amounts go to a few threads of
their own, apart from the loop's default executor (lease releases), so that heavy requests
queue among themselves. The tokenizer releases the GIL while it works; pure-Python work in a
thread still shares it, but the loop gets its turns (every 5 ms) instead of none.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from deployments.protocol import ChatPrompt, chat_chars

# Text work (characters to render and tokenize, entries to serialize) that runs inline; a
# 1 MB prompt takes ~0.7 s to tokenize on the CI machine.
INLINE_TEXT_WORK = 16_384
TEXT_WORKERS = 2
T = TypeVar("T")


class TextWork:
    def __init__(self, workers: int = TEXT_WORKERS) -> None:
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="pdserve-text")

    async def run(self, cost: int, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`, whose time grows with `cost`: inline when small, else in the pool."""
        if cost <= INLINE_TEXT_WORK:
            return fn(*args)
        return await self.offload(fn, *args)

    async def offload(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in the pool, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(
            self.pool, functools.partial(fn, *args)
        )


def prompt_chars(prompt: str | list[int] | ChatPrompt) -> int:
    """How much text work a prompt is: its characters (a conversation's together), or the
    number of token ids to check."""
    if isinstance(prompt, ChatPrompt):
        return chat_chars(prompt.messages)
    return len(prompt)
