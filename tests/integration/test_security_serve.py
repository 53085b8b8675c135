"""API keys and TLS on a real Serve app: HTTPS (Serve's own `ssl_*` options), gRPC over TLS on
the proxy's extra port (deployments/router/grpc_ingress.py) beside the plain one, API keys on both
APIs, and the engines' side channel on mutual TLS while KV crosses over NIXL. Keys must not
appear in any log Ray wrote or in any exported span."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import pytest

from deployments.launch import GRPC_MAX_MESSAGE_BYTES
from pdserve.client import GenerationClient, generate_request
from pdserve.trace_sink import SpanSink, start_sink
from tests.integration.serving import AppSettings, ProxyTLS, ServeCluster, ServedApp
from tests.tls_certs import CertificateAuthority
from tests.waiting import wait_until

# Its own Ray, started for TLS at the proxies: after every other Serve test (conftest.py).
pytestmark = [pytest.mark.integration, pytest.mark.proxy_tls]

KEYS = ["key-one-7f3a9c", "key-two-b81d2e"]
WRONG_KEY = "key-wrong-55e0aa"
FILE_KEYS = ["key-file-one-0c4e91", "key-file-two-d27a63"]
PROMPT = "Security review: " + "the quick brown fox jumps over the lazy dog. " * 4
PARAMS = {"max_tokens": 8, "temperature": 0.0}


@dataclass
class Secured:
    sink: SpanSink
    ca: str
    served: ServedApp
    key_file: Path


@pytest.fixture(scope="module")
def secured(
    tmp_path_factory: pytest.TempPathFactory, serve_cluster: ServeCluster
) -> Iterator[Secured]:
    directory = tmp_path_factory.mktemp("pki")
    ca = CertificateAuthority(directory, "pdserve")
    proxy = ca.issue("proxy", ("localhost",))
    engine = ca.issue("engine", ("pdserve-engine",))
    sink = SpanSink()
    otlp, otlp_port = start_sink(sink)
    settings = AppSettings(
        app={
            "model": "tiny",
            "engine_args": {"max_model_len": 256, "kv_cache_memory_bytes": 16 << 20},
            "num_cpus_per_engine": 0.5,
            "transport": "nixl",
            "api_key": KEYS,
            "side_channel_tls": asdict(engine),
            "otlp_endpoint": f"http://127.0.0.1:{otlp_port}",
        },
        tls=ProxyTLS(keyfile=str(proxy.keyfile), certfile=str(proxy.certfile)),
    )
    key_file = directory / "api-keys"  # a third key from a file, as a mounted Secret gives it
    key_file.write_text(f"{FILE_KEYS[0]}\n")
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("PDSERVE_API_KEY_FILE", str(key_file))
            with serve_cluster.serving(settings) as served:
                yield Secured(sink, ca.certfile.as_posix(), served, key_file)
    finally:
        otlp.stop(0)


def _grpc(secured: Secured, key: str = "", roots: bytes | None = None) -> GenerationClient:
    """A client of the plain gRPC port, or of the TLS port trusting `roots`."""
    return secured.served.grpc(api_key=key, roots=roots)


def test_grpc_needs_a_valid_key(secured: Secured) -> None:
    for key in ("", WRONG_KEY):
        with _grpc(secured, key) as client:
            with pytest.raises(grpc.RpcError) as refused:
                client.complete(generate_request(PROMPT, **PARAMS), timeout=60)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "API key" in refused.value.details()
            assert WRONG_KEY not in refused.value.details()
            with pytest.raises(grpc.RpcError) as refused:
                client.abort("anything")
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            anonymous = client.health()  # probes need no key, and learn the status alone
            assert anonymous.status and not anonymous.engines
            with pytest.raises(grpc.RpcError) as refused:
                client.step_trace(keep_steps=16)  # the schedulers' traces: keyed callers only
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with _grpc(secured, KEYS[1]) as client:
        assert client.health().engines  # every replica's figures, for a caller with a key
        traces = client.step_trace().engines  # off here: each engine says so
        assert traces and all("keeps no step trace" in e.error for e in traces)
        completion = client.complete(generate_request(PROMPT, **PARAMS), timeout=120)
    assert len(completion.token_ids) == PARAMS["max_tokens"]
    assert completion.route == "disaggregated"

    def transfers() -> list[dict]:
        return secured.sink.find(lambda s: s["name"] == "kv_transfer")

    # The KV crossed over NIXL after a handshake on the mutual-TLS side channel, and nothing
    # was recomputed for want of it.
    assert wait_until(lambda: bool(transfers()), timeout_s=30)
    assert {s["attributes"]["pdserve.kv.outcome"] for s in transfers()} == {"ok"}


def test_a_rotated_key_file_takes_effect_without_a_restart(secured: Secured) -> None:
    """The Secret rotated in place (kubelet swaps the file under the mount): the new key works
    and the old one stops, within the routers' one-second look at the file, no replica
    restarted."""

    def refused(key: str) -> bool:
        with _grpc(secured, key) as client:
            try:
                client.model_info()
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAUTHENTICATED
                return True
        return False

    assert not refused(FILE_KEYS[0]) and refused(FILE_KEYS[1])
    rotated = secured.key_file.with_name("api-keys.new")
    rotated.write_text(f"{FILE_KEYS[1]}\n")
    rotated.replace(secured.key_file)
    assert wait_until(lambda: not refused(FILE_KEYS[1]), timeout_s=15)
    assert wait_until(lambda: refused(FILE_KEYS[0]), timeout_s=15)
    assert not refused(KEYS[0])  # the keys from elsewhere are untouched


def test_an_empty_key_variable_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    from deployments.app_config import AppConfig
    from deployments.launch import deploy

    monkeypatch.setenv("PDSERVE_API_KEY", " , ")
    with pytest.raises(ValueError, match="PDSERVE_API_KEY is set but holds no key"):
        deploy(AppConfig.from_args({"model": "tiny"}), {})


def test_grpc_refuses_an_oversized_message_in_the_proxy(secured: Secured) -> None:
    """Serve's proxy would read and decode up to 2 GiB before the Router checks the key: the
    app bounds it (ServeOptions.grpc_max_message_bytes), so gRPC itself refuses the call."""
    oversized = "word " * (GRPC_MAX_MESSAGE_BYTES // 5 + 1)
    for key in ("", KEYS[1]):
        with _grpc(secured, key) as client:
            with pytest.raises(grpc.RpcError) as refused:
                client.complete(generate_request(oversized, **PARAMS), timeout=60)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "larger than max" in refused.value.details()


def test_grpc_over_tls_gives_the_same_tokens(secured: Secured) -> None:
    roots = Path(secured.ca).read_bytes()
    with (
        _grpc(secured, KEYS[0]) as plain,
        _grpc(secured, KEYS[0], roots) as tls,
    ):
        expected = plain.complete(generate_request(PROMPT, **PARAMS), timeout=120)
        got = tls.complete(generate_request(PROMPT, **PARAMS), timeout=120)
        assert got.token_ids == expected.token_ids
        with _grpc(secured, WRONG_KEY, roots) as wrong:
            with pytest.raises(grpc.RpcError) as refused:
                wrong.complete(generate_request(PROMPT, **PARAMS), timeout=60)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with _grpc(secured, KEYS[0], b"") as untrusted:  # system roots: not our CA
        with pytest.raises(grpc.RpcError) as refused:
            untrusted.health(timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def _https(
    secured: Secured,
    path: str,
    body: dict | None = None,
    key: str = "",
    ours: bool = True,
    request_id: str = "",
) -> tuple[int, str]:
    """(status, body) of a call to the HTTPS endpoint, trusting our CA (or the system's)."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    if request_id:
        headers["X-Request-Id"] = request_id
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(secured.served.http_url + path, data=data, headers=headers)
    context = ssl.create_default_context(cafile=secured.ca if ours else None)
    try:
        with urllib.request.urlopen(request, timeout=120, context=context) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_https_needs_a_valid_key(secured: Secured) -> None:
    body = {"model": "tiny", "prompt": PROMPT, **PARAMS}
    for key in ("", WRONG_KEY):
        status, text = _https(secured, "/v1/completions", body, key)
        assert status == 401
        assert json.loads(text)["error"]["code"] == "invalid_api_key"
        assert WRONG_KEY not in text
    assert _https(secured, "/health")[0] == 200
    status, text = _https(secured, "/v1/completions", body, KEYS[0])
    assert status == 200, text
    assert json.loads(text)["usage"]["completion_tokens"] == PARAMS["max_tokens"]
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        _https(secured, "/health", ours=False)


def test_keys_are_in_no_log_and_no_span(secured: Secured) -> None:
    # Each key, and a wrong one, over both APIs (whatever ran before in this module).
    with _grpc(secured, WRONG_KEY) as client, pytest.raises(grpc.RpcError):
        client.complete(generate_request(PROMPT, **PARAMS), timeout=60)
    body = {"model": "tiny", "prompt": PROMPT, **PARAMS}
    assert _https(secured, "/v1/completions", body, WRONG_KEY)[0] == 401
    for key in KEYS:
        with _grpc(secured, key) as client:
            client.complete(generate_request(PROMPT, **PARAMS), timeout=120)
        assert _https(secured, "/v1/completions", body, key)[0] == 200

    def refusals_exported() -> bool:
        return bool(
            secured.sink.find(lambda s: s["attributes"].get("pdserve.outcome") == "unauthenticated")
        )

    assert wait_until(refusals_exported, timeout_s=30)
    # One more request, the last: once its lines are in the logs and its spans exported, so
    # are those of every request before it.
    last = f"last-{uuid.uuid4().hex}"
    assert _https(secured, "/v1/completions", body, KEYS[0], request_id=last)[0] == 200
    assert wait_until(lambda: _logged_and_exported(secured, last), timeout_s=30)
    spans = repr(secured.sink.find(lambda s: True))
    files = [path for path in _ray_logs().rglob("*") if path.is_file()]
    assert files
    texts = [path.read_bytes() for path in files]
    for key in (*KEYS, WRONG_KEY):
        assert key not in spans
        assert not [
            path.name for path, text in zip(files, texts, strict=True) if key.encode() in text
        ]


def _ray_logs() -> Path:
    import ray

    return Path(ray._private.worker._global_node.get_logs_dir_path())


def _logged_and_exported(secured: Secured, request_id: str) -> bool:
    """The request's access lines are in the logs of Serve's proxy and of the Router replica,
    and its spans, the Router's and the decode engine's, are exported."""
    serve = _ray_logs() / "serve"
    for pattern in ("proxy_*.log", "replica_pdserve_Router_*.log"):
        if not any(request_id in path.read_text(errors="replace") for path in serve.glob(pattern)):
            return False
    routers = secured.sink.find(
        lambda s: (
            s["name"] == "router.request"
            and request_id in str(s["attributes"].get("pdserve.request_id", ""))
        )
    )
    return bool(routers) and "decode" in secured.sink.trace(routers[0]["trace_id"])
