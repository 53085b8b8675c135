"""API keys and TLS on a real Serve app: HTTPS (Serve's own `ssl_*` options), gRPC over TLS on
the proxy's extra port (deployments/router/grpc_ingress.py) beside the plain one, API keys on both
APIs, and the engines' side channel on mutual TLS while KV crosses over NIXL. Keys must not
appear in any log Ray wrote or in any exported span."""

from __future__ import annotations

import json
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import pytest

from deployments.app import AppConfig
from deployments.launch import APP_NAME, ServeOptions, start, stop
from pdserve.client import GenerationClient, generate_request
from pdserve.trace_sink import SpanSink, start_sink
from tests.integration.serve_utils import free_port, wait_until
from tests.tls_certs import CertificateAuthority

pytestmark = pytest.mark.integration

KEYS = ["key-one-7f3a9c", "key-two-b81d2e"]
WRONG_KEY = "key-wrong-55e0aa"
PROMPT = "Security review: " + "the quick brown fox jumps over the lazy dog. " * 4
PARAMS = {"max_tokens": 8, "temperature": 0.0}


@dataclass
class Secured:
    sink: SpanSink
    ca: str
    grpc_port: int
    grpc_tls_port: int
    https: str


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    directory = tmp_path_factory.mktemp("pki")
    ca = CertificateAuthority(directory, "pdserve")
    proxy = ca.issue("proxy", ("localhost",))
    engine = ca.issue("engine", ("pdserve-engine",))
    sink = SpanSink()
    otlp, otlp_port = start_sink(sink)
    config = AppConfig.from_args(
        {
            "model": "tiny",
            "engine_args": {"max_model_len": 256, "kv_cache_memory_bytes": 16 << 20},
            "num_cpus_per_engine": 0.5,
            "transport": "nixl",
            "api_key": KEYS,
            "side_channel_tls": asdict(engine),
            "otlp_endpoint": f"http://127.0.0.1:{otlp_port}",
        }
    )
    grpc_port, http_port, tls_port = free_port(), free_port(), free_port()
    options = ServeOptions(
        grpc_port=grpc_port,
        http_port=http_port,
        num_cpus=6,
        ssl_keyfile=proxy.keyfile,
        ssl_certfile=proxy.certfile,
        grpc_tls_port=tls_port,
    )
    start(config, options)
    try:
        yield Secured(
            sink, ca.certfile.as_posix(), grpc_port, tls_port, f"https://localhost:{http_port}"
        )
    finally:
        stop()
        otlp.stop(0)


def _grpc(port: int, key: str = "", roots: bytes | None = None) -> GenerationClient:
    return GenerationClient(f"localhost:{port}", APP_NAME, key, roots)


def test_grpc_needs_a_valid_key(secured: Secured) -> None:
    for key in ("", WRONG_KEY):
        with _grpc(secured.grpc_port, key) as client:
            with pytest.raises(grpc.RpcError) as refused:
                client.complete(generate_request(PROMPT, **PARAMS), timeout=60)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "API key" in refused.value.details()
            assert WRONG_KEY not in refused.value.details()
            with pytest.raises(grpc.RpcError) as refused:
                client.abort("anything")
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert client.health().status  # probes need no key
    with _grpc(secured.grpc_port, KEYS[1]) as client:
        completion = client.complete(generate_request(PROMPT, **PARAMS), timeout=120)
    assert len(completion.token_ids) == PARAMS["max_tokens"]
    assert completion.route == "disaggregated"

    def transfers() -> list[dict]:
        return secured.sink.find(lambda s: s["name"] == "kv_transfer")

    # The KV crossed over NIXL after a handshake on the mutual-TLS side channel, and nothing
    # was recomputed for want of it.
    assert wait_until(lambda: bool(transfers()), timeout_s=30)
    assert {s["attributes"]["pdserve.kv.outcome"] for s in transfers()} == {"ok"}


def test_grpc_over_tls_gives_the_same_tokens(secured: Secured) -> None:
    roots = Path(secured.ca).read_bytes()
    with (
        _grpc(secured.grpc_port, KEYS[0]) as plain,
        _grpc(secured.grpc_tls_port, KEYS[0], roots) as tls,
    ):
        expected = plain.complete(generate_request(PROMPT, **PARAMS), timeout=120)
        got = tls.complete(generate_request(PROMPT, **PARAMS), timeout=120)
        assert got.token_ids == expected.token_ids
        with _grpc(secured.grpc_tls_port, WRONG_KEY, roots) as wrong:
            with pytest.raises(grpc.RpcError) as refused:
                wrong.complete(generate_request(PROMPT, **PARAMS), timeout=60)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with _grpc(secured.grpc_tls_port, KEYS[0], b"") as untrusted:  # system roots: not our CA
        with pytest.raises(grpc.RpcError) as refused:
            untrusted.health(timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def _https(
    secured: Secured, path: str, body: dict | None = None, key: str = "", ours: bool = True
) -> tuple[int, str]:
    """(status, body) of a call to the HTTPS endpoint, trusting our CA (or the system's)."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(secured.https + path, data=data, headers=headers)
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
    with _grpc(secured.grpc_port, WRONG_KEY) as client, pytest.raises(grpc.RpcError):
        client.complete(generate_request(PROMPT, **PARAMS), timeout=60)
    body = {"model": "tiny", "prompt": PROMPT, **PARAMS}
    assert _https(secured, "/v1/completions", body, WRONG_KEY)[0] == 401
    for key in KEYS:
        with _grpc(secured.grpc_port, key) as client:
            client.complete(generate_request(PROMPT, **PARAMS), timeout=120)
        assert _https(secured, "/v1/completions", body, key)[0] == 200

    def refusals_exported() -> bool:
        return bool(
            secured.sink.find(lambda s: s["attributes"].get("pdserve.outcome") == "unauthenticated")
        )

    assert wait_until(refusals_exported, timeout_s=30)
    time.sleep(2)  # the last batch of spans and log lines
    spans = repr(secured.sink.find(lambda s: True))
    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    files = [path for path in logs.rglob("*") if path.is_file()]
    assert files
    texts = [path.read_bytes() for path in files]
    for key in (*KEYS, WRONG_KEY):
        assert key not in spans
        assert not [
            path.name for path, text in zip(files, texts, strict=True) if key.encode() in text
        ]
