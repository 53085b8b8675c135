"""The KV index's load board (deployments/cluster/load_board.py): entries kept sorted by load
through random arrivals, changes and removals, and their packed copy (the records the C
search walks: deployments/cluster/csrc/search.h) in step with them — a KV usage change that
leaves the key as it was included — through pickling; and the C search over a packed board
answering as over its entries."""

from __future__ import annotations

import math
import pickle
import random

import pytest

from deployments.cluster import cost_search, kv_scoring
from deployments.cluster.kv_cost import DEFAULT_WEIGHTS, load_key
from deployments.cluster.load_board import RECORD, LoadBoard, PackedBoard
from engine.core.kv_events import EngineLoad
from tests.unit.test_cost_search import big_cluster, both
from tests.unit.test_kv_scoring import ROLES, lookup_from_an_index


def check(board: LoadBoard, loads: dict[str, EngineLoad | None], bits: dict[str, int]) -> None:
    snapshot = board.snapshot
    assert isinstance(snapshot, PackedBoard)
    assert list(snapshot) == sorted((load_key(loads[r]), r, bits[r]) for r in loads)
    assert snapshot.names == tuple(r for _, r, _ in snapshot)
    records = [RECORD.unpack_from(snapshot.packed, i * RECORD.size) for i in range(len(loads))]
    assert len(snapshot.packed) == RECORD.size * len(loads)
    for (key, replica, bit), (k, busy, queued, usage, position) in zip(
        snapshot, records, strict=True
    ):
        load = loads[replica]
        assert (k, position) == (key, bit.bit_length() - 1)
        if load is None:
            assert math.isnan(busy)
        else:
            running = load.num_running + load.num_waiting
            numbers = (running, load.queued_prompt_tokens, load.kv_cache_usage)
            assert (busy, queued, usage) == numbers


@pytest.mark.parametrize("seed", range(20))
def test_the_packed_board_stays_in_step_with_its_entries(seed: int) -> None:
    rng = random.Random(seed)
    board = LoadBoard()
    loads: dict[str, EngineLoad | None] = {}
    bits = {f"r{i}": 1 << rng.randrange(200) for i in range(30)}
    for _ in range(300):
        replica = rng.choice(list(bits))
        if rng.random() < 0.15:
            board.remove(replica)
            loads.pop(replica, None)
        else:
            old = loads.get(replica)
            if old is not None and rng.random() < 0.3:  # the key stays, the usage moves
                load: EngineLoad | None = old._replace(kv_cache_usage=rng.random())
            elif rng.random() < 0.1:
                load = None
            else:
                load = EngineLoad(rng.randint(0, 3), rng.randint(0, 2), rng.randint(0, 500), 0.5)
            board.place(replica, load, bits[replica])
            loads[replica] = load
        check(board, loads, bits)
    crossed = pickle.loads(pickle.dumps(board.snapshot))
    assert isinstance(crossed, PackedBoard) and crossed == board.snapshot
    assert (crossed.packed, crossed.names) == (board.snapshot.packed, board.snapshot.names)


@pytest.mark.parametrize("seed", range(8))
def test_the_c_search_over_a_packed_board_answers_as_over_its_entries(seed: int) -> None:
    """An index's answer (packed boards) and the same answer with a packed copy that does not
    fit its entries (the C search then walks the entries): both as the reference."""
    rng = random.Random(seed)
    found = lookup_from_an_index(big_cluster(rng), rng)
    assert isinstance(found.board, PackedBoard)
    assert all(isinstance(board, PackedBoard) for _, board in found.roles.values())
    unfit = PackedBoard(tuple(found.board), b"", found.board.names)
    roles = {r: (mask, PackedBoard(tuple(b), b"", b.names)) for r, (mask, b) in found.roles.items()}
    parts = (found.replicas, found.groups, unfit, found.bits, found.known, roles)
    unpacked = kv_scoring.Holdings(*parts, found._held, found.request_tokens)
    ongoing = {r: rng.randint(0, 6) for r in found.replicas if rng.random() < 0.5}
    for answer in (found, unpacked):
        search = kv_scoring._Search(answer, 150, 16, DEFAULT_WEIGHTS, 0, ongoing)
        for role in (None, *ROLES):
            both(search, answer.role_mask(role), ("unknown-0",), one=False)
            both(search, answer.role_mask(role), (), one=True)
    assert cost_search.native() is not None


def test_the_c_search_reads_the_records_of_a_packed_board() -> None:
    """The walk takes its loads from the records (not the Holdings): records that say every
    engine is far busier than its Holding does give other costs than the reference's."""
    rng = random.Random(3)
    found = lookup_from_an_index(big_cluster(rng), rng)

    def busier(board: PackedBoard) -> PackedBoard:
        fields = [list(r) for r in RECORD.iter_unpack(board.packed)]
        for f in fields:
            f[1] = 1000.0 if math.isnan(f[1]) else f[1] + 1000.0
        packed = b"".join(RECORD.pack(*f) for f in fields)
        return PackedBoard(tuple(board), packed, board.names)

    roles = {r: (mask, busier(b)) for r, (mask, b) in found.roles.items()}
    parts = (found.replicas, found.groups, busier(found.board), found.bits, found.known, roles)
    skewed = kv_scoring.Holdings(*parts, found._held, found.request_tokens)
    args = (None, skewed.known, (), False, 150, 16, 0, 32.0, 0.9, 0.1)
    costs, _ = cost_search.native().up_to_least(skewed, *args)
    reference, _ = kv_scoring._Search(skewed, 150, 16, DEFAULT_WEIGHTS).reference(skewed.known)
    walked = [r for r in costs if r not in found._held]
    assert walked and all(costs[r] > reference.get(r, 0.0) for r in walked if r in reference)
    assert costs != reference
