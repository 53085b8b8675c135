"""The requests `pdserve bench router-sim` routes: a Mooncake-format trace's, its clock scaled to
the asked request rate and each 512-token block id made into the KV blocks it spans (block
hashes derived from the id: requests sharing ids share those blocks, as chained hashes do),
or synthetic multi-turn conversations behind shared system prompts."""

from __future__ import annotations

import functools
import hashlib
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.bench.replay import TRACE_BLOCK_TOKENS, trace_rows

if TYPE_CHECKING:
    from pdserve.bench.router_sim import RouterSimConfig

SYSTEM_PROMPTS = 16
SYSTEM_BLOCKS = 32
TURNS = 4
THINK_TIME_S = 2.0


@dataclass(frozen=True)
class SimRequest:
    at_s: float
    hashes: list[bytes]  # the prompt's full blocks
    prompt_tokens: int
    output_len: int


def sim_requests(config: RouterSimConfig) -> list[SimRequest]:
    if config.trace:
        requests = _traced(config)
    elif config.workload == "phases":
        requests = _phased(config)
    else:
        requests = _synthetic(config)
    return sorted(requests, key=lambda r: r.at_s)


def _traced(config: RouterSimConfig) -> list[SimRequest]:
    assert config.trace is not None
    rows = trace_rows(Path(config.trace), config.num_requests)
    span = (rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1000
    scale = len(rows) / config.request_rate / span if span > 0 else 0.0
    per_id = max(1, TRACE_BLOCK_TOKENS // config.block_size)
    requests = []
    for row in rows:
        blocks = min(config.max_prompt_blocks, row["input_length"] // config.block_size)
        hashes = [_block(h, j) for h in row["hash_ids"] for j in range(per_id)][:blocks]
        requests.append(
            SimRequest(
                at_s=(row["timestamp"] - rows[0]["timestamp"]) / 1000 * scale,
                hashes=hashes,
                prompt_tokens=max(1, len(hashes) * config.block_size),
                output_len=max(1, row["output_length"]),
            )
        )
    return requests


@functools.lru_cache(maxsize=1 << 16)
def _block(hash_id: int, part: int) -> bytes:
    """A block's hash, a sha256 digest as the engines' (its size is what the index keeps)."""
    return hashlib.sha256((hash_id * 1024 + part).to_bytes(8, "little")).digest()


def _synthetic(config: RouterSimConfig) -> list[SimRequest]:
    """Conversations of TURNS turns; each starts behind one of SYSTEM_PROMPTS shared system
    prompts, and each later turn extends the whole conversation so far after a think time."""
    rng = random.Random(config.seed)
    conversations = -(-config.num_requests // TURNS)
    rate = config.request_rate / TURNS  # conversations starting per second
    next_id = 1 << 40  # past the system prompts' blocks
    requests, start = [], 0.0
    for _ in range(conversations):
        start += rng.expovariate(rate)
        system = rng.randrange(SYSTEM_PROMPTS)
        history = [_block(system, j) for j in range(SYSTEM_BLOCKS)]
        at = start
        for _ in range(TURNS):
            new = rng.randrange(4, 32)  # the new message and the last answer, in blocks
            history = history + [_block(next_id + j, 0) for j in range(new)]
            next_id += new
            hashes = history[: config.max_prompt_blocks]
            tokens = len(hashes) * config.block_size
            requests.append(SimRequest(at, hashes, tokens, rng.randrange(32, 256)))
            at += rng.expovariate(1 / THINK_TIME_S)
    return requests[: config.num_requests] if len(requests) > config.num_requests else requests


def _phased(config: RouterSimConfig) -> list[SimRequest]:
    """A load that shifts: `phases` equal phases of Poisson arrivals, alternately
    prefill-heavy (long prompts, 16-token answers) and decode-heavy (prompts a sixteenth as
    long, long answers). Prompts share nothing: what the phases test is the P:D split."""
    rng = random.Random(config.seed)
    per_phase = -(-config.num_requests // max(1, config.phases))
    long_blocks = max(
        1, min(config.max_prompt_blocks, config.phase_prompt_tokens // config.block_size)
    )
    requests, at, next_id = [], 0.0, 1 << 41  # past the other workloads' blocks
    for i in range(config.num_requests):
        at += rng.expovariate(config.request_rate)
        prefill_heavy = (i // per_phase) % 2 == 0
        blocks = long_blocks if prefill_heavy else max(1, long_blocks // 16)
        output_len = 16 if prefill_heavy else config.phase_output_tokens
        hashes = [_block(next_id + j, 0) for j in range(blocks)]
        next_id += blocks
        requests.append(SimRequest(at, hashes, blocks * config.block_size, output_len))
    return requests
