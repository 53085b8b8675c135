"""PDConnector's admission checks and block arithmetic (gRPC transport, idle), and what a
read checks in the blocks it landed (a real gRPC read from the engine to itself)."""

from __future__ import annotations

import time

import pytest
import torch

from connector.metadata import RemoteKV, tokens_hash
from connector.pd_connector import PDConnector
from engine.config import KVTransferConfig
from engine.core.block_pool import NULL_BLOCK_ID
from engine.core.kv_cache_utils import KVCacheBlock
from engine.request import Request, RequestStatus, SamplingParams
from tests.waiting import wait_until

PROMPT = list(range(100, 121))  # 21 tokens


@pytest.fixture
def connector():
    conn = PDConnector(KVTransferConfig(connector="grpc"), "decode-0", "hash", block_size=4)
    yield conn
    conn.close()


def remote(num_tokens: int = 20, prompt=PROMPT, block_ids=None) -> dict:
    ids = block_ids if block_ids is not None else [7, 8, 9, 10, 11]
    return RemoteKV(
        "prefill-0",
        "p-1",
        ids,
        "127.0.0.1",
        1,
        "lease-1",
        num_tokens,
        tokens_hash(prompt[:num_tokens]),
        [f"{b:016x}" for b in ids],  # checksums: only their form is checked here
    ).to_params()


def request(params: dict, prompt=PROMPT) -> Request:
    return Request("r", prompt, SamplingParams(), kv_transfer_params=params)


def test_params_made_for_this_prompt_are_accepted(connector):
    connector.validate_request(request(remote()))


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (remote(prompt=[1] * 21), "made for another prompt"),
        (remote(num_tokens=30), "made for another prompt"),
        ({"do_remote_prefill": True, "remote_engine_id": "x"}, "lack a field"),
        ({**remote(), "remote_block_checksums": None}, "one checksum per remote block"),
        ({**remote(), "remote_block_checksums": ["0" * 16]}, "one checksum per remote block"),
        ({**remote(), "remote_block_checksums": ["xyz"] * 5}, "16-digit hex"),
        ({**remote(), "remote_block_checksums": ["g" * 16] * 5}, "16-digit hex"),
    ],
)
def test_unusable_params_are_refused_at_admission(connector, params, message):
    with pytest.raises(ValueError, match=message):
        connector.validate_request(request(params))


def test_reads_only_the_blocks_after_the_local_hits(connector):
    req = request(remote(num_tokens=20))
    # 8 tokens (2 blocks) hit locally; 20 - 8 = 12 more come from the remote... but the
    # last prompt token (index 20) is computed here, so 20 - 8 = 12 tokens: blocks 2..4.
    num, load_async = connector.get_num_new_matched_tokens(req, 8)
    assert (num, load_async) == (12, True)
    blocks = [KVCacheBlock(i) for i in (30, 31, 32, 33, 34, 35)]
    connector.update_state_after_alloc(req, blocks, 12)
    meta = connector.build_connector_meta(None)
    (load,) = meta.loads
    assert load.local_block_ids == [32, 33, 34]
    assert load.remote_block_ids == [9, 10, 11]
    assert load.checksums == [f"{b:016x}" for b in (9, 10, 11)]  # the remote blocks' own
    assert connector.stats["blocks_requested"] == 3
    assert req.timing.kv_load_descriptors == 1  # 32..34 <- 9..11: one run


def test_a_read_counts_the_runs_consecutive_on_both_sides(connector):
    req = request(remote(num_tokens=20, block_ids=[7, 8, 12, 13, 14]))
    connector.get_num_new_matched_tokens(req, 0)
    blocks = [KVCacheBlock(i) for i in (30, 31, 32, 40, 41, 42)]
    connector.update_state_after_alloc(req, blocks, 20)
    (load,) = connector.build_connector_meta(None).loads
    assert load.local_block_ids == [30, 31, 32, 40, 41]
    # 30,31 <- 7,8 | 32 <- 12 | 40,41 <- 13,14: a break on either side starts a run.
    assert req.timing.kv_load_descriptors == 3


def test_a_remote_of_another_block_size_is_planned_and_moves_nothing(connector):
    """Its blocks hold 16 tokens, ours 4: two of its blocks for five of ours. The read is
    planned (the handshake refuses it) and counts no descriptor; nothing raises here."""
    req = request(remote(num_tokens=20, block_ids=[7, 8]))
    connector.get_num_new_matched_tokens(req, 0)
    connector.update_state_after_alloc(req, [KVCacheBlock(i) for i in range(30, 36)], 20)
    (load,) = connector.build_connector_meta(None).loads
    assert len(load.local_block_ids) == 5 and load.remote_block_ids == [7, 8]
    assert req.timing.kv_load_descriptors == 0


def test_a_full_local_hit_only_releases_the_lease(connector):
    req = request(remote(num_tokens=20))
    assert connector.get_num_new_matched_tokens(req, 20) == (0, False)
    connector.update_state_after_alloc(req, [KVCacheBlock(i) for i in range(6)], 0)
    meta = connector.build_connector_meta(None)
    assert meta.loads == [] and [r.lease_id for r in meta.releases] == ["lease-1"]


def test_a_request_aborted_before_allocation_leaves_nothing_behind(connector):
    req = request(remote(num_tokens=20))
    connector.get_num_new_matched_tokens(req, 0)  # matched, then the pool had no room
    req.status = RequestStatus.FINISHED_ABORTED
    assert connector.request_finished(req, []) == (False, None)
    assert connector._matched == {}
    assert not connector.has_pending_transfers()


def _read_back(conn: PDConnector, remote_kv, local_ids: list[int]) -> set[int]:
    """Read `remote_kv`'s blocks into `local_ids` over the connector's own side channel (a
    real gRPC read, from this engine to itself); the local blocks found invalid."""
    from connector.metadata import ConnectorMetadata, LoadSpec

    load = LoadSpec("reader", remote_kv, local_ids, remote_kv.block_ids, remote_kv.block_checksums)
    conn.start_load_kv(ConnectorMetadata(loads=[load]))
    assert wait_until(lambda: "reader" in conn.get_finished()[1], 30, 0.01), "never ended"
    return conn.get_block_ids_with_load_errors()


def test_a_remote_null_block_is_read_but_never_checked(connector):
    # A sliding-window prompt's table holds the null block left of its window: padding rows
    # write their K/V there, so its bytes may change after the checksums were taken.
    cache = torch.randn(8, 2, 4, 16)
    connector.register_kv_caches(cache)
    tokens = list(range(12))
    leased = connector.worker.lease_blocks("window", [NULL_BLOCK_ID, 5, 6], tokens)
    cache[NULL_BLOCK_ID].add_(1.0)  # scratch written after the hand-off
    assert _read_back(connector, leased, [2, 3, 4]) == set()
    stats = connector.stats
    assert stats["blocks_verified"] == 2 and stats["checksum_failures"] == 0
    # A real block changed after its hand-off is still caught.
    leased = connector.worker.lease_blocks("window-2", [NULL_BLOCK_ID, 5, 6], tokens)
    cache[6, 1, 3, 0] += 1.0
    assert _read_back(connector, leased, [2, 3, 4]) == {4}
    assert connector.stats["blocks_corrupted"] == 1


def test_a_read_waits_on_its_remote_as_long_as_kv_transfer_config_says(monkeypatch):
    """handshake_timeout_s bounds the first call, heartbeat_timeout_s the renewal before the
    read and the release after it, read_timeout_base_s the read's own deadline (an engine
    on a loaded machine may be given more room than the shipped second)."""
    from connector.metadata import ConnectorMetadata, LoadSpec
    from connector.side_channel_client import SideChannelClient

    asked: list[tuple[str, float]] = []
    for name in ("handshake", "renew_lease", "release"):
        original = getattr(SideChannelClient, name)

        def recording(self, *args, _name=name, _original=original, **kwargs):
            asked.append((_name, kwargs["timeout_s"] if "timeout_s" in kwargs else args[-1]))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(SideChannelClient, name, recording)
    deadlines = {"handshake_timeout_s": 7.0, "heartbeat_timeout_s": 3.0}
    config = KVTransferConfig(connector="grpc", read_timeout_base_s=100.0, **deadlines)
    conn = PDConnector(config, "decode-0", "hash", block_size=4)
    try:
        conn.register_kv_caches(torch.randn(8, 2, 4, 16))
        leased = conn.worker.lease_blocks("p", [5, 6], list(range(8)))
        load = LoadSpec("reader", leased, [2, 3], leased.block_ids, leased.block_checksums)
        started = time.monotonic()
        conn.start_load_kv(ConnectorMetadata(loads=[load]))
        deadline = conn.worker.reads._active["reader"].deadline - started
        assert 100.0 <= deadline < 110.0, deadline  # the base and the bytes at 100 MB/s
        assert wait_until(lambda: "reader" in conn.get_finished()[1], 30, 0.01), "never ended"
        assert conn.get_block_ids_with_load_errors() == set()
        # The watch may renew once more if the read outlives a heartbeat period.
        assert asked[:2] == [("handshake", 7.0), ("renew_lease", 3.0)]
        assert asked[-1] == ("release", 3.0)
        assert set(asked[2:-1]) <= {("renew_lease", 3.0)}
    finally:
        conn.close()
