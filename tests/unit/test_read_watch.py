"""ReadWatch, the heartbeat of reads in flight, against a real side channel (a PDConnector's,
gRPC) and a socket that accepts connections and never answers (a frozen engine)."""

from __future__ import annotations

import socket
import time

import pytest
import torch

from connector.pd_connector import PDConnector
from connector.read_watch import ReadWatch
from connector.side_channel_client import SideChannelClient
from engine.config import KVTransferConfig
from tests.waiting import wait_until

SECRET = "s3cret"


@pytest.fixture
def producer():
    conn = PDConnector(KVTransferConfig(connector="grpc", secret=SECRET), "p-0", "h", 4)
    conn.register_kv_caches(torch.zeros(8, 2, 4, 16))
    yield conn
    conn.close()


@pytest.fixture
def silent_port():
    """Listens (connections complete in the kernel's backlog), never reads or answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield listener.getsockname()[1]


def _stepped() -> ReadWatch:
    """A watch whose own thread never beats (a period of a minute): the test beats it."""
    return ReadWatch(KVTransferConfig().heartbeat_timeout_s, period_s=60)


def _later(watch: ReadWatch) -> None:
    """One heartbeat, as if every watched read had run a period already."""
    watch.beat(now=time.monotonic() + watch.period_s)


def test_a_live_lease_is_renewed_and_a_cancelled_one_dooms_its_read(producer):
    client = SideChannelClient("127.0.0.1", producer.side_channel_port, SECRET)
    watch = _stepped()
    try:
        kept = producer.worker.lease_blocks("kept", [1, 2], list(range(8)))
        gone = producer.worker.lease_blocks("gone", [3], list(range(4)))
        watch.add("r-kept", client, kept.lease_id)
        watch.add("r-gone", client, gone.lease_id)
        _later(watch)
        assert watch.renewals == 2 and watch.take_doomed() == {}
        producer.cancel_request("gone")  # the producer let go of the blocks (or they expired)
        _later(watch)
        doomed = watch.take_doomed()
        assert list(doomed) == ["r-gone"] and not doomed["r-gone"].unreachable
        assert "no longer holds the blocks" in doomed["r-gone"].reason
        assert watch.take_doomed() == {}  # each once
        watch.remove("r-kept")
        _later(watch)
        assert watch.renewals == 3  # nothing watched any more
    finally:
        watch.close()
        client.close()


def test_one_unanswered_renewal_dooms_every_read_from_that_remote(silent_port):
    client = SideChannelClient("127.0.0.1", silent_port, SECRET)
    watch = _stepped()
    try:
        asked: list[str] = []
        renew = client.renew_lease
        client.renew_lease = lambda lease_id, timeout_s=None: (
            asked.append(lease_id) or renew(lease_id, timeout_s)
        )
        watch.add("a", client, "lease-a")
        watch.add("b", client, "lease-b")
        _later(watch)
        doomed = watch.take_doomed()
        assert set(doomed) == {"a", "b"} and all(d.unreachable for d in doomed.values())
        assert "DEADLINE_EXCEEDED" in doomed["a"].reason  # waited for no answer, in vain
        # One silent renewal condemns its remote: the second read did not wait again.
        assert asked == ["lease-a"]
    finally:
        watch.close()
        client.close()


def test_the_watch_thread_finds_a_dead_remote_by_itself(producer):
    port = producer.side_channel_port
    client = SideChannelClient("127.0.0.1", port, SECRET)
    watch = ReadWatch(KVTransferConfig().heartbeat_timeout_s)
    try:
        lease = producer.worker.lease_blocks("x", [1], list(range(4)))
        watch.add("r", client, lease.lease_id)
        producer.close()  # the producer goes away: nothing listens on its port
        assert wait_until(lambda: "r" in watch.take_doomed(), 10)
    finally:
        watch.close()
        client.close()
