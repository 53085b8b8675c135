"""connector/kv_reads.py's side-channel clients: a remote found silent gets a new client (a new
channel) next time — it reads the TLS files again and reaches whatever engine serves that
address now — while the retired one stays open for reads that may still hold it."""

from __future__ import annotations

from connector.kv_reads import _RETIRED_CLIENTS, KVReads
from connector.metadata import RemoteKV
from engine.config import KVTransferConfig


def remote(port: int) -> RemoteKV:
    return RemoteKV("prefill-0", "req", [1], "127.0.0.1", port, "lease", 16, "hash", ["0"])


def test_a_silent_remote_gets_a_new_client_and_the_old_ones_are_closed_in_turn() -> None:
    reads = KVReads(KVTransferConfig(connector="grpc", secret="s"), "decode-0", "h", transport=None)  # type: ignore[arg-type]
    try:
        first = reads._client(remote(1))
        assert reads._client(remote(1)) is first  # reused while the remote answers
        reads._mark_silent(remote(1))
        second = reads._client(remote(1))
        assert second is not first and reads._retired == [first]
        closed = []
        first.close = lambda: closed.append(first)  # type: ignore[method-assign]
        for port in range(2, 2 + _RETIRED_CLIENTS):  # more silent remotes than are kept
            reads._client(remote(port))
            reads._mark_silent(remote(port))
        assert closed == [first] and len(reads._retired) == _RETIRED_CLIENTS
    finally:
        reads.close()
