"""Mutual TLS on the engines' side channel (kv_transfer_config.tls): a real gRPC server and
clients with certificates made here. Only a caller with a certificate the shared CA signed gets
through; the server's certificate is checked against the shared name, not the address."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import grpc
import pytest

from connector.side_channel import SideChannelServer
from connector.side_channel_client import SideChannelClient, SideChannelError
from engine.config import KVTransferConfig, SideChannelTLS
from tests.integration.side_channel.shared import COMPAT_HASH, ENGINE_ID, SECRET, block, make_cache
from tests.tls_certs import CertificateAuthority
from tests.waiting import wait_until

NAME = "pdserve-engine"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SideChannelTLS]:
    directory = tmp_path_factory.mktemp("pki")
    ours, theirs = (
        CertificateAuthority(directory, "ours"),
        CertificateAuthority(directory, "theirs"),
    )
    return {
        "server": SideChannelTLS(**asdict(ours.issue("server", (NAME,)))),
        "client": SideChannelTLS(**asdict(ours.issue("client", (NAME,)))),
        "stranger": SideChannelTLS(**asdict(theirs.issue("stranger", (NAME,)))),
    }


@pytest.fixture(scope="module")
def served(pki: dict[str, SideChannelTLS]) -> Iterator[tuple[SideChannelServer, int]]:
    config = KVTransferConfig(connector="grpc", secret=SECRET, tls=pki["server"])
    server = SideChannelServer(config, ENGINE_ID, COMPAT_HASH, make_cache(), b"meta", "grpc")
    yield server, server.start()
    server.stop(0)


@pytest.fixture(scope="module")
def server(served: tuple[SideChannelServer, int]) -> SideChannelServer:
    return served[0]


@pytest.fixture(scope="module")
def port(served: tuple[SideChannelServer, int]) -> int:
    return served[1]


def _handshake(port: int, tls: SideChannelTLS | None) -> str:
    client = SideChannelClient("127.0.0.1", port, SECRET, timeout_s=5.0, tls=tls)
    try:
        return client.handshake("decode-0", COMPAT_HASH, "grpc").engine_id
    finally:
        client.close()


def test_a_peer_with_a_certificate_of_the_shared_ca_reads_blocks(
    server: SideChannelServer, port: int, pki: dict[str, SideChannelTLS]
) -> None:
    assert _handshake(port, pki["client"]) == ENGINE_ID
    lease_id = server.leases.add("req-tls", [3, 7], 30.0).lease_id
    client = SideChannelClient("127.0.0.1", port, SECRET, timeout_s=5.0, tls=pki["client"])
    try:
        got = dict(client.read_blocks(lease_id, [7, 3]))
        assert got == {7: block(make_cache(), 7), 3: block(make_cache(), 3)}
        wrong_secret = SideChannelClient(
            "127.0.0.1", port, "nope", timeout_s=5.0, tls=pki["client"]
        )
        with pytest.raises(SideChannelError) as refused:  # TLS is not the only check
            wrong_secret.handshake("decode-0", COMPAT_HASH, "grpc")
        assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
        wrong_secret.close()
    finally:
        client.close()


def test_callers_without_a_certificate_of_the_shared_ca_do_not_get_through(
    port: int, pki: dict[str, SideChannelTLS]
) -> None:
    for tls in (None, pki["stranger"]):  # plain text; another CA's certificate
        with pytest.raises(SideChannelError) as refused:
            _handshake(port, tls)
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE


def test_the_server_name_is_checked(port: int, pki: dict[str, SideChannelTLS]) -> None:
    wrong_name = SideChannelTLS(**{**asdict(pki["client"]), "server_name": "someone-else"})
    with pytest.raises(SideChannelError) as refused:
        _handshake(port, wrong_name)
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE


def test_tls_settings_are_validated(tmp_path: Path, pki: dict[str, SideChannelTLS]) -> None:
    good = asdict(pki["client"])
    assert KVTransferConfig(tls=good).tls == pki["client"]  # a dict, as engine_args carry it
    with pytest.raises(ValueError, match="tls keys"):
        KVTransferConfig(tls={**good, "verify": False})
    with pytest.raises(ValueError, match=r"tls\.ca_certs must be a non-empty string"):
        KVTransferConfig(tls={**good, "ca_certs": ""})
    missing = SideChannelTLS(**{**good, "keyfile": str(tmp_path / "absent.key")})
    with pytest.raises(ValueError, match=r"^kv_transfer_config\.tls\.keyfile: No such file"):
        missing.pem()


def test_a_rotated_server_certificate_is_served_without_a_restart(
    tmp_path: Path, pki: dict[str, SideChannelTLS]
) -> None:
    """cert-manager renews the mounted Secret in place: new connections get the new
    certificate (here one for another name), no restart."""
    (tmp_path / "pki").mkdir()
    ca = CertificateAuthority(tmp_path / "pki", "rotating")
    first, renewed = ca.issue("old", (NAME,)), ca.issue("new", ("pdserve-engine-v2",))
    live = tmp_path / "live"
    live.mkdir()
    paths = {name: live / name for name in ("tls.crt", "tls.key", "ca.crt")}

    def install(issued) -> None:  # as kubelet swaps a Secret volume's files
        for name, source in zip(
            paths, (issued.certfile, issued.keyfile, issued.ca_certs), strict=True
        ):
            staged = live / f".{name}"
            staged.write_bytes(Path(source).read_bytes())
            staged.replace(paths[name])

    install(first)
    tls = SideChannelTLS(str(paths["tls.crt"]), str(paths["tls.key"]), str(paths["ca.crt"]), NAME)
    config = KVTransferConfig(connector="grpc", secret=SECRET, tls=tls)
    server = SideChannelServer(config, ENGINE_ID, COMPAT_HASH, make_cache(), b"meta", "grpc")
    rotated_port = server.start()
    try:
        client = SideChannelTLS(**{**asdict(ca.issue("client", (NAME,))), "server_name": NAME})
        renamed = SideChannelTLS(**{**asdict(client), "server_name": "pdserve-engine-v2"})
        assert _handshake(rotated_port, client) == ENGINE_ID
        with pytest.raises(SideChannelError):
            _handshake(rotated_port, renamed)
        install(renewed)  # the renewal

        def serves_the_new_one() -> bool:
            try:
                return _handshake(rotated_port, renamed) == ENGINE_ID
            except SideChannelError:
                return False

        assert wait_until(serves_the_new_one, timeout_s=15)
        with pytest.raises(SideChannelError):
            _handshake(rotated_port, client)  # the old name is no longer served
    finally:
        server.stop(0)
