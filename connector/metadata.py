"""What travels between the connector's scheduler side and worker side each step, and the
kv_transfer_params a prefill engine hands out."""

from __future__ import annotations

import hashlib
import json
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.block_checksums import CHECKSUM_SCHEME, parse_checksums
from engine.kv_connector import KV_CACHE_LAYOUT

if TYPE_CHECKING:
    import torch

COMPAT_HASH_PARAM = "remote_compat_hash"


@dataclass(frozen=True)
class RemoteKV:
    """Where a request's prompt KV lives: the prefill side's kv_transfer_params, parsed."""

    engine_id: str
    request_id: str
    block_ids: list[int]
    host: str
    port: int
    lease_id: str
    num_tokens: int  # prompt positions whose KV the remote computed
    tokens_hash: str  # of those tokens: the KV is only good for a prompt that starts with them
    # One per block, as the producer wrote it (engine/block_checksums.py): a read is verified
    # against them before anything is computed from it.
    block_checksums: list[str]
    # The producer's compatibility hash (compatibility_hash): routers send the request to an
    # engine of the same (the handshake refuses any other).
    compat_hash: str = ""

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> RemoteKV:
        try:
            block_ids = [int(b) for b in params["remote_block_ids"]]
            return cls(
                engine_id=str(params["remote_engine_id"]),
                request_id=str(params["remote_request_id"]),
                block_ids=block_ids,
                host=str(params["remote_host"]),
                port=int(params["remote_port"]),
                lease_id=str(params["lease_id"]),
                num_tokens=int(params["remote_num_tokens"]),
                tokens_hash=str(params["remote_tokens_hash"]),
                block_checksums=parse_checksums(
                    params.get("remote_block_checksums"), len(block_ids)
                ),
                compat_hash=producer_compat_hash(params),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"kv_transfer_params with do_remote_prefill lack a field or have a bad one: {exc}"
            ) from exc

    def to_params(self) -> dict[str, Any]:
        return {
            "do_remote_prefill": True,
            "remote_engine_id": self.engine_id,
            "remote_request_id": self.request_id,
            "remote_block_ids": list(self.block_ids),
            "remote_host": self.host,
            "remote_port": self.port,
            "lease_id": self.lease_id,
            "remote_num_tokens": self.num_tokens,
            "remote_tokens_hash": self.tokens_hash,
            "remote_block_checksums": list(self.block_checksums),
            COMPAT_HASH_PARAM: self.compat_hash,
        }


def producer_compat_hash(params: dict[str, Any] | None) -> str:
    """The compatibility hash of the engine whose KV `params` hand on ("" if none)."""
    if not params or not params.get("do_remote_prefill"):
        return ""
    return str(params.get(COMPAT_HASH_PARAM) or "")


def tokens_hash(token_ids: list[int]) -> str:
    return hashlib.sha256(array("q", token_ids).tobytes()).hexdigest()


@dataclass(frozen=True)
class LoadSpec:
    """Read `remote_block_ids` of `remote` into our `local_block_ids` for `request_id`."""

    request_id: str
    remote: RemoteKV
    local_block_ids: list[int]
    remote_block_ids: list[int]
    checksums: list[str]  # of the remote blocks, as written: each local block must match


@dataclass
class ConnectorMetadata:
    loads: list[LoadSpec] = field(default_factory=list)
    # Leases to give back without reading (the local prefix cache had everything).
    releases: list[RemoteKV] = field(default_factory=list)
    # Requests whose in-flight read must stop (aborted).
    cancels: list[str] = field(default_factory=list)


def compatibility_hash(
    *,
    model: str,
    dtype: str | torch.dtype,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    layout: str = KV_CACHE_LAYOUT,
    **extra: str | int | float | bool,
) -> str:
    """sha256 hex of the canonical JSON of everything that must match for blocks to be
    interchangeable. `extra` adds fields (e.g. a quantization scheme) on both sides."""
    fields: dict[str, Any] = {
        "model": model,
        "dtype": str(dtype).removeprefix("torch."),
        "num_layers": num_layers,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "block_size": block_size,
        "layout": layout,
        "block_checksum": CHECKSUM_SCHEME,  # both sides must compute checksums alike
        **extra,
    }
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()
