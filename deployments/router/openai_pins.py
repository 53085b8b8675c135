"""What an OpenAI request says about keeping its KV for the session's next turn.

- `prompt_cache_key` (OpenAI's field) names the agent's session: a turn replaces its
  session's pin, and under the engine's `continuum` policy a session's turn is pinned for a
  TTL predicted from its tool calls' gaps (engine/core/pins.py).
- `cache_control` on a message or a content part — `{"type": "ephemeral", "ttl": "5m"}`, as
  agent frameworks send it — asks for the turn's KV to be kept that long (the longest asked;
  "5m" when no ttl is given; up to "1h"). Without a `prompt_cache_key` the turn is a session
  of its own: its pin lasts until the TTL.
- The tool whose result the turn carries (the last assistant message's tool call, where
  tool results follow it; the first one, where it made several) is what the gap before this
  turn measured.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from typing import Any

from engine.pin_request import MAX_PIN_TTL_S, PinRequest

_DEFAULT_TTL = "5m"
_TTL = re.compile(r"^(\d+)([smh])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600}


def ttl_seconds(cache_control: dict[str, Any], where: str) -> float:
    """A cache_control's TTL in seconds (ValueError naming `where` if it is not one)."""
    kind = cache_control.get("type")
    if kind != "ephemeral":
        raise ValueError(f"{where}.cache_control.type must be 'ephemeral', got {kind!r}")
    unknown = sorted(set(cache_control) - {"type", "ttl"})
    if unknown:
        raise ValueError(f"{where}.cache_control has unknown fields {unknown}")
    ttl = cache_control.get("ttl", _DEFAULT_TTL)
    match = _TTL.match(ttl) if isinstance(ttl, str) else None
    seconds = int(match.group(1)) * _UNIT_S[match.group(2)] if match else 0
    if not 0 < seconds <= MAX_PIN_TTL_S:
        raise ValueError(
            f"{where}.cache_control.ttl must be like '30s', '5m' or '1h' (at most 1h), got {ttl!r}"
        )
    return float(seconds)


def kv_pin(
    session: str | None, ttls: Sequence[float], messages: Sequence[dict[str, Any]] = ()
) -> PinRequest | None:
    """The pin a request asks for: its session (`prompt_cache_key`) and the longest of the
    `ttls` its cache_control fields gave; None when it gives neither."""
    if session is None and not ttls:
        return None
    key = session if session else f"turn-{uuid.uuid4().hex}"
    return PinRequest(key, max(ttls) if ttls else None, _last_tool(messages))


def _last_tool(messages: Sequence[dict[str, Any]]) -> str:
    """The function the conversation's last assistant turn called, where tool results end
    the messages ("" otherwise)."""
    if not messages or messages[-1].get("role") != "tool":
        return ""
    for message in reversed(messages):
        if message.get("role") == "assistant":
            calls = message.get("tool_calls") or []
            function = calls[0].get("function", {}) if calls and isinstance(calls[0], dict) else {}
            name = function.get("name") if isinstance(function, dict) else None
            return name if isinstance(name, str) else ""
    return ""
