"""The KVTransfer side channel over real gRPC on loopback: the handshake and its refusals,
secrets on every RPC, ReadBlocks returning exact bytes (in chunks for large blocks) and its
refusals, BlockData written by hand as protobuf writes it. The prefill side is this package's
server process (conftest.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest

from connector.block_data import decode_block_data, encode_block_data
from connector.metadata import compatibility_hash
from connector.side_channel_client import SideChannelClient
from connector.transport import BlockRead
from protos.pdserve.v1 import kv_transfer_pb2 as pb
from tests.integration.side_channel.shared import (
    BLOCK_BYTES,
    COMPAT_HASH,
    ENGINE_ID,
    SECRET,
    SHAPE,
    ServerProcess,
    block,
    finish,
    make_cache,
    make_server,
    refused,
    transport_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

# ---------------------------------------------------------------------------------- handshake


def test_handshake(client: SideChannelClient) -> None:
    reply = client.handshake("decode-0", COMPAT_HASH, "grpc", expected_engine_id=ENGINE_ID)
    assert (reply.engine_id, reply.compatibility_hash) == (ENGINE_ID, COMPAT_HASH)
    assert (reply.num_blocks, reply.block_bytes) == (SHAPE[0], BLOCK_BYTES)
    assert reply.transport_metadata == b"meta" and reply.transport == "grpc"
    assert client.remote == reply


def test_handshake_refusals(client: SideChannelClient) -> None:
    other = compatibility_hash(
        model="tiny", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=16, block_size=4
    )
    message = refused(
        grpc.StatusCode.FAILED_PRECONDITION, lambda: client.handshake("d", other, "grpc")
    )
    assert other in message and COMPAT_HASH in message
    refused(grpc.StatusCode.FAILED_PRECONDITION, lambda: client.handshake("d", COMPAT_HASH, "nixl"))
    refused(
        grpc.StatusCode.NOT_FOUND,
        lambda: client.handshake("d", COMPAT_HASH, "grpc", expected_engine_id="prefill-9"),
    )


@pytest.mark.parametrize("secret", ["wrong", ""])
def test_wrong_secret_refused_on_every_rpc(server: ServerProcess, secret: str) -> None:
    lease_id = server.lease(f"req-secret-{secret}", [1, 2])
    bad = server.client(secret)
    calls: list[Callable[[], Any]] = [
        lambda: bad.handshake("d", COMPAT_HASH, "grpc"),
        lambda: bad.renew_lease(lease_id),
        lambda: bad.release(lease_id),
        lambda: list(bad.read_blocks(lease_id, [1])),
        lambda: bad.lend_prefix([b"h"]),
    ]
    for call in calls:
        assert "UNAUTHENTICATED" in refused(grpc.StatusCode.UNAUTHENTICATED, call)
    bad.close()
    good = server.client()
    assert good.release(lease_id)  # the refused Release did not end it
    good.close()


def test_an_engine_that_does_not_lend_refuses_loans(client: SideChannelClient) -> None:
    message = refused(grpc.StatusCode.FAILED_PRECONDITION, lambda: client.lend_prefix([b"h"]))
    assert "does not lend" in message


# ---------------------------------------------------------------------------------- reads


def test_read_blocks_returns_exact_bytes(server: ServerProcess, client: SideChannelClient) -> None:
    lease_id = server.lease("req-read", [3, 4, 5, 9, 20])
    expected = make_cache()
    got = list(client.read_blocks(lease_id, [9, 3, 4, 20]))
    assert [b for b, _ in got] == [9, 3, 4, 20]
    for block_id, data in got:
        assert data == block(expected, block_id)


def test_read_refusals(server: ServerProcess, client: SideChannelClient) -> None:
    lease_id = server.lease("req-refusals", [1, 2])
    message = refused(
        grpc.StatusCode.PERMISSION_DENIED, lambda: list(client.read_blocks(lease_id, [2, 3]))
    )
    assert "[3]" in message
    refused(grpc.StatusCode.OUT_OF_RANGE, lambda: list(client.read_blocks(lease_id, [1, 32])))
    refused(grpc.StatusCode.NOT_FOUND, lambda: list(client.read_blocks("no-such-lease", [1])))
    refused(grpc.StatusCode.INVALID_ARGUMENT, lambda: list(client.read_blocks(lease_id, [1, 1])))


def test_block_data_by_hand_is_protobuf_block_data() -> None:
    data = bytes(range(256)) * 3
    ours = encode_block_data(300, 1 << 33, memoryview(data), 1 << 40)
    assert pb.BlockData.FromString(ours) == pb.BlockData(
        block_id=300, offset=1 << 33, data=data, block_bytes=1 << 40
    )
    # proto3 leaves zeros out; an unknown field is skipped
    theirs = pb.BlockData(block_id=0, offset=0, data=b"xy", block_bytes=2).SerializeToString()
    chunk = decode_block_data(theirs + b"\x28\x05")
    assert (chunk.block_id, chunk.offset, bytes(chunk.data), chunk.block_bytes) == (0, 0, b"xy", 2)
    for malformed in (ours[:-1], ours[:4], b"\x08\xff", b"\x0f"):
        with pytest.raises(ValueError):
            decode_block_data(malformed)


def test_large_blocks_travel_in_chunks() -> None:
    server = make_server(chunk_bytes=300)  # 1024-byte blocks: chunks of 300, 300, 300, 124
    port = server.start()
    try:
        lease = server.leases.add("req-chunks", [5, 6, 7], 30.0)
        client = SideChannelClient("127.0.0.1", port, SECRET, timeout_s=5.0)
        got = dict(client.read_blocks(lease.lease_id, [7, 5]))
        assert got == {7: block(make_cache(), 7), 5: block(make_cache(), 5)}
        transport = transport_for(port)
        transport.start_read(BlockRead("t-chunks", ENGINE_ID, [1, 2], [5, 6], lease.lease_id))
        assert finish(transport, "t-chunks") is None
        local = transport._caches[0]
        assert local is not None and bytes(local[1].numpy()) == block(make_cache(), 5)
        transport.close()
        client.close()
    finally:
        server.stop(0)
