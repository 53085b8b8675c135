"""KVTransferConfig: how an engine takes part in KV transfer (also accepted as a dict)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

TransportName = Literal["nixl", "grpc"]


@dataclass(frozen=True)
class KVTransferConfig:
    connector: TransportName = "nixl"
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0  # 0: pick a free port
    secret: str = ""
    lease_seconds: float = 30.0
    kv_load_failure_policy: Literal["recompute", "fail"] = "recompute"
    # A stable name for this engine in handshakes and kv_transfer_params ("" = random).
    engine_id: str = ""

    def __post_init__(self) -> None:
        if self.connector not in ("nixl", "grpc"):
            raise ValueError(f"connector must be 'nixl' or 'grpc', got {self.connector!r}")
        port = self.side_channel_port
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"side_channel_port must be in [0, 65535], got {port!r}")
        if not isinstance(self.lease_seconds, (int, float)) or self.lease_seconds <= 0:
            raise ValueError(f"lease_seconds must be > 0, got {self.lease_seconds!r}")
        if self.kv_load_failure_policy not in ("recompute", "fail"):
            raise ValueError(
                "kv_load_failure_policy must be 'recompute' or 'fail', "
                f"got {self.kv_load_failure_policy!r}"
            )
        if not isinstance(self.secret, str):
            raise ValueError("secret must be a string")

    @classmethod
    def from_any(cls, value: KVTransferConfig | dict[str, Any]) -> KVTransferConfig:
        if isinstance(value, KVTransferConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"kv_transfer_config must be a dict, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown kv_transfer_config keys {unknown}; known: {sorted(known)}")
        return cls(**value)
