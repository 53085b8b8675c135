"""`pdserve bench replay --trace FILE`: `bench serve`'s measurements over a recorded trace in
Mooncake's format (JSONL: `timestamp` in ms, `input_length`, `output_length`, `hash_ids`: an
id per 512-token block of the prompt, equal ids meaning equal blocks).

Each hash id becomes a block of token ids drawn from a generator seeded by the id (and the
workload's seed), so requests whose ids share a leading run share that prefix, token for
token, as the traced requests did. Token counts (blocks included) are scaled by
`trace_token_scale` and the clock by `trace_time_scale`, so a trace of 15,000-token prompts
fits a small model and a small machine; every configuration compared gets the same requests
at the same moments.
"""

from __future__ import annotations

import asyncio
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.bench import serve
from pdserve.bench.workloads import Send, TokenDraw

if TYPE_CHECKING:
    from pdserve.bench.serve import ServeBenchConfig

TRACE_BLOCK_TOKENS = 512  # Mooncake's hash_ids each name this many prompt tokens


@dataclass(frozen=True)
class ReplayedRequest:
    at_s: float  # since the replay began
    prompt: list[int]
    output_len: int


def replay_max_tokens(config: ServeBenchConfig) -> int:
    """The longest sequence the replay produces: prompt and output, scaled."""
    scale = config.trace_token_scale
    rows = trace_rows(_trace(config), config.trace_max_requests)
    return max(_scaled(r["input_length"], scale) + _scaled(r["output_length"], scale) for r in rows)


def _trace(config: ServeBenchConfig) -> Path:
    if config.trace is None:
        raise ValueError("the replay workload replays a trace: --trace FILE")
    return Path(config.trace)


def _scaled(tokens: int, scale: float) -> int:
    return max(1, round(tokens * scale))


def replay_requests(config: ServeBenchConfig, vocab_size: int) -> list[ReplayedRequest]:
    """The trace's first `trace_max_requests` requests, scaled, as token ids."""
    return _replayed(
        _trace(config),
        config.trace_max_requests,
        config.trace_token_scale,
        config.trace_time_scale,
        vocab_size,
        config.seed,
    )


@functools.lru_cache(maxsize=4)
def _replayed(
    path: Path, limit: int, token_scale: float, time_scale: float, vocab_size: int, seed: int
) -> list[ReplayedRequest]:
    block_len = max(1, round(TRACE_BLOCK_TOKENS * token_scale))
    blocks: dict[int, list[int]] = {}

    def block(hash_id: int) -> list[int]:
        if hash_id not in blocks:
            blocks[hash_id] = TokenDraw(vocab_size, seed * 1_000_003 + hash_id)(block_len)
        return blocks[hash_id]

    requests = []
    rows = trace_rows(path, limit)
    for number, row in enumerate(rows):
        input_len = _scaled(row["input_length"], token_scale)
        tokens = [t for hash_id in row["hash_ids"] for t in block(hash_id)][:input_len]
        if len(tokens) < input_len:  # the trace's last block was rounded down: a tail of its own
            tail = TokenDraw(vocab_size, seed * 1_000_003 - number - 1)
            tokens += tail(input_len - len(tokens))
        requests.append(
            ReplayedRequest(
                at_s=(row["timestamp"] - rows[0]["timestamp"]) / 1000 * time_scale,
                prompt=tokens,
                output_len=_scaled(row["output_length"], token_scale),
            )
        )
    return requests


def trace_rows(path: Path, limit: int) -> list[dict]:
    rows = []
    with path.open() as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                checked = {
                    "timestamp": float(row["timestamp"]),
                    "input_length": int(row["input_length"]),
                    "output_length": int(row["output_length"]),
                    "hash_ids": [int(h) for h in row["hash_ids"]],
                }
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path.name} line {number}: not a Mooncake trace record") from exc
            rows.append(checked)
            if limit and len(rows) == limit:
                break
    if not rows:
        raise ValueError(f"{path.name} holds no requests")
    return rows


async def replay(config: ServeBenchConfig, vocab_size: int, send: Send) -> None:
    """Send every replayed request at its moment, whatever is still in flight."""
    loop = asyncio.get_running_loop()
    began = loop.time()

    async def at(request: ReplayedRequest) -> None:
        await asyncio.sleep(max(0.0, began + request.at_s - loop.time()))
        await send(request.prompt, request.output_len, "replay")

    await asyncio.gather(*(at(r) for r in replay_requests(config, vocab_size)))


@dataclass
class ReplayBenchConfig(serve.ServeBenchConfig):
    """bench serve's settings, with the replay workload."""

    workload: str = field(default="replay", init=False)


CONFIG = ReplayBenchConfig
FLAGS = serve.FLAGS
run = serve.run
