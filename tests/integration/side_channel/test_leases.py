"""Leases on the prefill side's blocks, over the side channel: renewal extends one, an expired
one refuses reads and renewals and is reported finished once (remembered as expired after),
release is idempotent and reported once, a lease expiring mid-stream ends the stream and holds
its blocks until the stream stopped, a block rewritten under a lease fences reads of it
(mid-stream, and at the release after a read); and the LeaseTable's own bookkeeping. Time is
the lease table's clock, moved on by the test (shared.ManualClock)."""

from __future__ import annotations

import grpc
import pytest

from connector.leases import BlocksRewritten, LeaseExpired, LeaseNotFound, LeaseTable
from connector.side_channel_client import SideChannelClient, SideChannelError
from tests.integration.side_channel.shared import SECRET, GatedServer, ServerProcess, refused
from tests.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def test_renew_extends_the_lease(server: ServerProcess, client: SideChannelClient) -> None:
    lease_id = server.lease("req-renew", [1], lease_seconds=0.6)
    server.advance(0.4)
    assert 0.4 < client.renew_lease(lease_id) <= 0.6
    server.advance(0.4)  # past the original expiry, within the renewed one
    assert [b for b, _ in client.read_blocks(lease_id, [1])] == [1]
    assert "req-renew" not in server.take_finished()


def test_expired_lease_refuses_and_is_finished(
    server: ServerProcess, client: SideChannelClient
) -> None:
    lease_id = server.lease("req-expire", [1, 2], lease_seconds=0.3)
    server.advance(0.45)
    message = refused(
        grpc.StatusCode.FAILED_PRECONDITION, lambda: list(client.read_blocks(lease_id, [1]))
    )
    assert "expired" in message
    refused(grpc.StatusCode.FAILED_PRECONDITION, lambda: client.renew_lease(lease_id))
    assert "req-expire" in server.take_finished()
    assert "req-expire" not in server.take_finished()
    # Remembered after it was taken: still "expired", not "unknown".
    refused(grpc.StatusCode.FAILED_PRECONDITION, lambda: client.renew_lease(lease_id))
    assert client.release(lease_id) is False


def test_release_is_finished_exactly_once(server: ServerProcess, client: SideChannelClient) -> None:
    lease_id = server.lease("req-release", [4, 5])
    assert client.release(lease_id) is True
    assert client.release(lease_id) is False  # idempotent
    assert "req-release" in server.take_finished()
    assert "req-release" not in server.take_finished()
    refused(grpc.StatusCode.NOT_FOUND, lambda: client.renew_lease(lease_id))
    refused(grpc.StatusCode.NOT_FOUND, lambda: list(client.read_blocks(lease_id, [4])))


def test_lease_expiring_mid_stream_ends_it_and_holds_blocks_until_stopped(
    gated_server: tuple[GatedServer, int],
) -> None:
    server, port = gated_server
    lease = server.leases.add("req-mid", list(range(10)), 0.35)
    client = SideChannelClient("127.0.0.1", port, SECRET, timeout_s=5.0)
    read: list[int] = []
    with pytest.raises(SideChannelError) as info:
        for block_id, _ in client.read_blocks(lease.lease_id, list(range(10))):
            read.append(block_id)
            if len(read) == 1:  # the next block waits at the gate: the lease expires first
                server.clock.advance(0.35)
                server.gate.set()
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION and "expired" in str(info.value)
    assert 1 <= len(read) < 10
    assert wait_until(lambda: "req-mid" in server.leases.take_finished(), 2.0)
    client.close()


def test_a_block_rewritten_under_the_lease_fences_the_read(
    gated_server: tuple[GatedServer, int],
) -> None:
    """Fencing over a real stream: a block rewritten (its generation moved) before it is
    sent ends the stream at that block, FAILED_PRECONDITION; one rewritten after it was sent
    cannot stop the stream, but the release then answers that the read is not to be used."""
    server, port = gated_server
    client = SideChannelClient("127.0.0.1", port, SECRET, timeout_s=5.0)
    ahead = server.leases.add("req-ahead", list(range(10)), 30.0)
    read: list[int] = []
    with pytest.raises(SideChannelError) as info:
        for block_id, _ in client.read_blocks(ahead.lease_id, list(range(10))):
            read.append(block_id)
            if len(read) == 1:  # block 5 is freed and reused before it is copied
                server.generations[5] = 1
                server.gate.set()
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "rewritten" in str(info.value)
    assert read == [0, 1, 2, 3, 4]  # the rewritten block never left
    assert info.value.lease_gone  # the reader counts it fenced
    renewal = refused(
        grpc.StatusCode.FAILED_PRECONDITION, lambda: client.renew_lease(ahead.lease_id)
    )
    assert "rewritten" in renewal
    assert client.release(ahead.lease_id) is False

    behind = server.leases.add("req-behind", [20, 21], 30.0)
    assert [b for b, _ in client.read_blocks(behind.lease_id, [20, 21])] == [20, 21]
    server.generations[20] = 1  # after its bytes left: only the release can tell
    assert client.release(behind.lease_id) is False
    assert server.leases.fences == 2  # one per lease, however many calls it refused
    assert wait_until(lambda: server.leases.take_finished() == {"req-ahead", "req-behind"}, 2.0)
    client.close()


def test_lease_table_fences_on_the_generations_it_recorded() -> None:
    generations = {1: 4, 2: 7}
    table = LeaseTable(generation_of=lambda b: generations.get(b, 0))
    lease = table.add("req-a", [1, 2, 3], 10.0)
    generations[9] = 1  # not under the lease: no matter
    table.check_live(lease.lease_id, [1, 2, 3])
    table.renew(lease.lease_id)
    generations[2] = 8
    table.check_live(lease.lease_id, [1, 3])  # the others still hold what was lent
    with pytest.raises(BlocksRewritten, match=r"blocks \[2\]"):
        table.check_live(lease.lease_id, [2])
    with pytest.raises(BlocksRewritten):
        table.renew(lease.lease_id)
    assert table.release(lease.lease_id) is False  # ended all the same: its blocks go back
    assert table.take_finished() == {"req-a"}
    assert table.fences == 1  # one lease, refused three times


def test_lease_table_holds_blocks_while_read_and_reports_each_end_once() -> None:
    now = [0.0]
    table = LeaseTable(clock=lambda: now[0])
    reading = table.add("req-a", [1, 2], 1.0)
    cancelled = table.add("req-b", [3], 1.0)
    with pytest.raises(ValueError):
        table.add("req-a", [4], 1.0)  # one lease per request
    table.open_read(reading.lease_id, [2])
    assert table.cancel_request("req-b")
    now[0] = 1.5  # req-a expires while its blocks are being copied
    assert table.take_finished() == {"req-b"}
    assert table.expirations == 1  # req-a's (req-b's was cancelled)
    assert table.num_active == 1
    table.close_read(reading.lease_id)
    assert table.take_finished() == {"req-a"}
    assert table.take_finished() == set() and table.num_active == 0
    with pytest.raises(LeaseExpired):
        table.renew(reading.lease_id)
    with pytest.raises(LeaseNotFound):
        table.renew(cancelled.lease_id)
    assert table.expirations == 1  # counted once, however often it was found expired
