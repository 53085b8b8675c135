"""`pdserve bench replay`'s requests from a Mooncake-format trace: shared hash ids are shared
prefixes token for token, counts and the clock scale, the same requests every time, bad
records refused with the line; and the replay sends each at its moment."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from pdserve.bench.replay import ReplayBenchConfig, replay_requests
from pdserve.bench.serve import RequestResult
from pdserve.bench.workloads import drive, max_tokens_needed

ROWS = [
    {"timestamp": 0, "input_length": 1500, "output_length": 64, "hash_ids": [1, 2, 3]},
    {"timestamp": 250, "input_length": 2048, "output_length": 32, "hash_ids": [1, 2, 4, 5]},
    {"timestamp": 500, "input_length": 700, "output_length": 1, "hash_ids": [9, 2]},
]


def trace_file(tmp_path: Path, rows: list[dict] = ROWS) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def config(path: str, **overrides: object) -> ReplayBenchConfig:
    return ReplayBenchConfig(trace=path, trace_token_scale=1 / 32, **overrides)  # type: ignore[arg-type]


def test_shared_hash_ids_are_shared_prefixes(tmp_path: Path) -> None:
    requests = replay_requests(config(trace_file(tmp_path)), 1000)
    first, second, third = (r.prompt for r in requests)
    assert [len(p) for p in (first, second, third)] == [47, 64, 22]  # 1500/32, 2048/32, 700/32
    block = 16  # 512 / 32
    assert first[: 2 * block] == second[: 2 * block]  # ids 1, 2
    assert first[2 * block : 3 * block] != second[2 * block : 3 * block]  # 3 against 4
    # id 9 then id 2 (cut at 22 tokens): no shared prefix, though a shared block
    assert third[:block] != first[:block] and third[block:] == first[block:22]
    assert [r.output_len for r in requests] == [2, 1, 1]
    assert [r.at_s for r in requests] == [0.0, 0.25, 0.5]
    again = replay_requests(config(trace_file(tmp_path), seed=0), 1000)
    assert [r.prompt for r in again] == [first, second, third]
    other_seed = replay_requests(config(trace_file(tmp_path), seed=1), 1000)
    assert other_seed[0].prompt != first


def test_scales_and_the_first_requests_only(tmp_path: Path) -> None:
    slow = config(trace_file(tmp_path), trace_time_scale=4.0, trace_max_requests=2)
    requests = replay_requests(slow, 1000)
    assert [r.at_s for r in requests] == [0.0, 1.0]
    assert max_tokens_needed(slow) == 64 + 1


def test_a_bad_record_is_refused_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + '{"timestamp": 3}\n')
    with pytest.raises(ValueError, match="line 2: not a Mooncake trace record"):
        replay_requests(config(str(path)), 1000)
    with pytest.raises(ValueError, match="--trace FILE"):
        max_tokens_needed(ReplayBenchConfig())  # what bench replay checks first


def test_the_replay_sends_every_request_in_the_traces_order(tmp_path: Path) -> None:
    sent: list[tuple[int, int, str]] = []

    async def send(prompt: list[int], output_len: int, kind: str) -> RequestResult:
        sent.append((len(prompt), output_len, kind))
        return RequestResult(ok=True, kind=kind)

    asyncio.run(drive(config(trace_file(tmp_path), trace_time_scale=0.01), 1000, send))
    assert sent == [(47, 2, "replay"), (64, 1, "replay"), (22, 1, "replay")]
