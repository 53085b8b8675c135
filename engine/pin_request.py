"""What a request asks of its KV once it finishes: kept for its session's next turn."""

from __future__ import annotations

from dataclasses import dataclass

MAX_PIN_TTL_S = 3600.0  # cache_control's longest ("1h")


@dataclass(frozen=True)
class PinRequest:
    """`key`: the agent's session (a turn replaces its session's pin); `ttl_s`: how long to
    keep the KV (None: predicted, under the continuum policy); `after_tool`: the tool whose
    result this turn carries (its gap since the previous turn is that tool's time)."""

    key: str
    ttl_s: float | None = None
    after_tool: str = ""

    def __post_init__(self) -> None:
        if not self.key:
            raise ValueError("a pin needs a session key")
        if self.ttl_s is not None and not 0 < self.ttl_s <= MAX_PIN_TTL_S:
            raise ValueError(
                f"pin ttl must be > 0 and at most {MAX_PIN_TTL_S:g} seconds, got {self.ttl_s}"
            )
