"""What a NIXL transport registers and publishes: a region per registered cache (shard), and
the metadata a peer reads them by (JSON: the agent's metadata base64-encoded, the regions)."""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import asdict, dataclass
from typing import Any

import torch

METADATA_VERSION = 2  # 2: a region per shard (1: one region, still written for one)


@dataclass(frozen=True)
class CacheRegion:
    """A registered cache; block b is the block_bytes bytes at base_addr + b * block_bytes."""

    base_addr: int
    block_bytes: int
    num_blocks: int
    mem_type: str  # "DRAM" or "VRAM"
    device_id: int

    def run_desc(self, first_block: int, num_blocks: int) -> tuple[int, int, int]:
        """The NIXL (address, length, device id) of `num_blocks` blocks from `first_block` on."""
        address = self.base_addr + first_block * self.block_bytes
        return (address, num_blocks * self.block_bytes, self.device_id)

    def check_block_ids(self, block_ids: list[int], side: str) -> None:
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"{side} block ids out of range [0, {self.num_blocks}): {bad[:8]}")


def region_of(kv_cache: torch.Tensor) -> CacheRegion:
    """The region of a block-contiguous [num_blocks, ...] cache tensor."""
    if kv_cache.dim() < 1 or kv_cache.shape[0] < 1:
        raise ValueError(
            f"kv_cache must be [num_blocks, ...] with num_blocks >= 1, got {tuple(kv_cache.shape)}"
        )
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous: a block is one byte range")
    if kv_cache.device.type == "cuda":
        index = kv_cache.device.index
        device_id = torch.cuda.current_device() if index is None else index
        mem_type = "VRAM"
    elif kv_cache.device.type == "cpu":
        device_id, mem_type = 0, "DRAM"  # NIXL's device id for host memory
    else:
        raise ValueError(f"NIXL transport supports cpu and cuda caches, got {kv_cache.device}")
    return CacheRegion(
        base_addr=kv_cache.data_ptr(),
        block_bytes=kv_cache[0].numel() * kv_cache.element_size(),
        num_blocks=kv_cache.shape[0],
        mem_type=mem_type,
        device_id=device_id,
    )


@dataclass(frozen=True)
class PeerMetadata:
    """What `local_metadata` publishes: JSON, the NIXL agent metadata base64-encoded, and
    one region per registered shard."""

    agent_name: str
    agent_metadata: bytes
    regions: tuple[CacheRegion, ...]

    def to_bytes(self) -> bytes:
        """Version 1 (the region's fields at the top) for one region, so engines of one
        shard read each other across a rolling upgrade; version 2 (a list) for several."""
        regions = [asdict(region) for region in self.regions]
        record: dict[str, Any] = {
            "agent_name": self.agent_name,
            "agent_metadata": base64.b64encode(self.agent_metadata).decode("ascii"),
        }
        if len(regions) == 1:
            record.update(version=1, **regions[0])
        else:
            record.update(version=METADATA_VERSION, regions=regions)
        return json.dumps(record, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> PeerMetadata:
        try:
            record = json.loads(data)
            version = record.get("version")
            if version not in (1, METADATA_VERSION):
                raise ValueError(f"version {version!r} is neither 1 nor {METADATA_VERSION}")
            records = [record] if version == 1 else record["regions"]
            regions = tuple(
                CacheRegion(
                    base_addr=int(region["base_addr"]),
                    block_bytes=int(region["block_bytes"]),
                    num_blocks=int(region["num_blocks"]),
                    mem_type=str(region["mem_type"]),
                    device_id=int(region["device_id"]),
                )
                for region in records
            )
            if not regions:
                raise ValueError("no regions")
            agent_metadata = base64.b64decode(record["agent_metadata"], validate=True)
            return cls(str(record["agent_name"]), agent_metadata, regions)
        except (ValueError, KeyError, TypeError, AttributeError, binascii.Error) as exc:
            raise ValueError(f"malformed NIXL transport metadata: {exc}") from exc

    def region(self, shard: int) -> CacheRegion:
        if not 0 <= shard < len(self.regions):
            raise ValueError(f"remote shard {shard} outside [0, {len(self.regions)})")
        return self.regions[shard]
