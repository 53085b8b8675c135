"""Credentials (deployments/credentials.py): where API keys and the KV secret come from, what a
caller must send, what the replicas are given, and the HTTP side through the real FastAPI app
(Starlette's test client; the Serve and gRPC sides run in
tests/integration/test_security_serve.py)."""

from __future__ import annotations

import json
import pickle
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from deployments.app import build_app
from deployments.app_config import AppConfig
from deployments.credentials import (
    KV_SECRET_FROM_ENV,
    MISSING,
    WRONG,
    ApiKeys,
    configured_keys,
    kv_secret,
    without_credentials,
)
from deployments.protocol import RequestLimits
from deployments.router.openai_api import build_openai_app
from deployments.router.router import RouterSettings
from deployments.router.telemetry import RouterTelemetry


@pytest.mark.parametrize("value", ["", " ", ",", " , ,", "\n"])
def test_a_key_variable_set_but_empty_refuses_to_start(monkeypatch, value: str) -> None:
    """Fail closed: an empty $PDSERVE_API_KEY is a mistake (a Secret key misnamed), not an
    instruction to serve without keys."""
    with pytest.raises(ValueError, match="PDSERVE_API_KEY is set but holds no key"):
        configured_keys(None, {"PDSERVE_API_KEY": value})
    monkeypatch.setenv("PDSERVE_API_KEY", value)
    with pytest.raises(ValueError, match="holds no key"):
        build_app({"model": "tiny"})


def test_keys_from_a_file_are_reloaded_when_it_changes(monkeypatch, tmp_path) -> None:
    """A mounted Secret, rotated in place: the new keys work and the old stop within a second
    of the change; a file emptied or removed refuses every key (never opens the API)."""
    import connector.file_watch as file_watch
    import deployments.credentials as credentials

    now = [100.0]
    monkeypatch.setattr(file_watch.time, "monotonic", lambda: now[0])
    path = tmp_path / "api-keys"
    path.write_text("old-1\nold-2\n")
    monkeypatch.setenv("PDSERVE_API_KEY_FILE", str(path))
    keys = _bound_settings(build_app({"model": "tiny"})).api_keys
    assert keys.required and keys.key_file == str(path)
    assert keys.refusal("Bearer old-2") is None and keys.refusal("Bearer new") == WRONG
    path.write_text("new, other")
    assert keys.refusal("Bearer old-1") is None  # looked at once a second, not per call
    now[0] += credentials.KEY_FILE_CHECK_S
    assert keys.refusal("Bearer new") is None and keys.refusal("Bearer old-1") == WRONG
    for broken in ("", "gone"):
        if broken == "gone":
            path.unlink()
        else:
            path.write_text(" \n , ")
        now[0] += credentials.KEY_FILE_CHECK_S
        assert keys.refusal("Bearer new") == WRONG and keys.refusal(None) == MISSING
    path.write_text("back")
    now[0] += credentials.KEY_FILE_CHECK_S
    assert keys.refusal("Bearer back") is None
    copied = pickle.loads(pickle.dumps(keys))  # as Serve ships it to a router replica
    assert copied.refusal("Bearer back") is None and copied.refusal("Bearer new") == WRONG


@pytest.mark.parametrize("content", [None, "", " , \n"])
def test_a_key_file_missing_or_empty_refuses_to_start(monkeypatch, tmp_path, content) -> None:
    path = tmp_path / "api-keys"
    if content is not None:
        path.write_text(content)
    monkeypatch.setenv("PDSERVE_API_KEY_FILE", str(path))
    with pytest.raises(ValueError, match="API key file PDSERVE_API_KEY_FILE names") as err:
        build_app({"model": "tiny"})
    assert str(tmp_path) not in str(err.value)  # no local path in the message


@pytest.mark.parametrize("keys", [ApiKeys.of(["k1"]), ApiKeys()])
def test_health_tells_the_engines_only_to_a_caller_with_a_key(keys: ApiKeys) -> None:
    from deployments.cluster.health import DEGRADED, HealthReport

    engines = [{"role": "decode", "replica_id": "r1", "state": "running", "num_blocks": 8}]

    fresh: list[bool] = []

    async def report(detailed: bool) -> HealthReport:
        fresh.append(detailed)
        return HealthReport(DEGRADED, engines)

    flow = SimpleNamespace(
        telemetry=RouterTelemetry(), config=SimpleNamespace(limits=RequestLimits())
    )
    client = TestClient(build_openai_app(lambda: flow, "tiny", 64, report, keys))
    anonymous = client.get("/health")
    assert anonymous.status_code == 200
    full = {"status": DEGRADED, "engines": engines}
    assert anonymous.json() == (full if not keys.required else {"status": DEGRADED})
    for authorization in ("Bearer wrong", "Basic k1"):
        if keys.required:
            assert client.get("/health", headers={"Authorization": authorization}).json() == {
                "status": DEGRADED
            }
    assert client.get("/health", headers={"Authorization": "Bearer k1"}).json() == full
    # Anonymous callers read the shared survey; those who see the figures, a fresh one.
    assert fresh[0] is not keys.required and fresh[-1] is True


def test_keys_come_from_the_argument_and_the_environment() -> None:
    assert configured_keys(None, {}) == []
    assert configured_keys("k1", {}) == ["k1"]
    assert configured_keys(["k1", "k2"], {"PDSERVE_API_KEY": " k3 , ,k4"}) == [
        "k1",
        "k2",
        "k3",
        "k4",
    ]
    with pytest.raises(ValueError, match="must not be empty"):
        configured_keys(["k1", " "], {})
    with pytest.raises(ValueError, match="string or a list of strings"):
        configured_keys([1], {})  # type: ignore[list-item]
    with pytest.raises(ValueError, match="must not be empty"):
        AppConfig.from_args({"api_key": ""})


@pytest.mark.parametrize(
    ("authorization", "refusal"),
    [
        (None, MISSING),
        ("", MISSING),
        ("Bearer", MISSING),
        ("Basic k1", MISSING),
        ("k1", MISSING),
        ("Bearer k3", WRONG),
        ("Bearer k1x", WRONG),
        ("Bearer k1", None),
        ("bearer  k2 ", None),  # the scheme is case-insensitive (RFC 7235)
    ],
)
def test_what_a_caller_must_send(authorization: str | None, refusal: str | None) -> None:
    assert ApiKeys.of(["k1", "k2"]).refusal(authorization) == refusal


def test_without_keys_everything_is_open_and_messages_never_name_a_key() -> None:
    assert ApiKeys().refusal(None) is None
    assert "k1" not in (ApiKeys.of(["k1"]).refusal("Bearer k1-wrong") or "")
    headers = {"Authorization": "Bearer k1", "traceparent": "00-ab-cd-01"}
    assert without_credentials(headers) == {"traceparent": "00-ab-cd-01"}


def test_the_router_gets_salted_digests_never_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_API_KEY", "from-env")
    app = build_app({"model": "tiny", "api_key": ["from-args"]})
    keys = _bound_settings(app).api_keys
    assert len(keys.digests) == 2
    for key in ("from-args", "from-env"):
        assert keys.refusal(f"Bearer {key}") is None
    assert keys.refusal("Bearer from-neither") == WRONG
    text = repr(_bound_settings(app))
    assert "from-args" not in text and "from-env" not in text
    again = _bound_settings(build_app({"model": "tiny", "api_key": ["from-args"]})).api_keys
    assert again.salt != keys.salt and not set(again.digests) & set(keys.digests)


def test_the_kv_secret_from_the_environment_is_never_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PDSERVE_KV_SECRET", "shared-secret")
    settings = _bound_settings(build_app({"model": "tiny"}))
    assert settings.kv_secret == KV_SECRET_FROM_ENV
    assert kv_secret(settings.kv_secret) == "shared-secret"  # what each replica reads
    assert _bound_settings(build_app({"model": "tiny", "kv_secret": "given"})).kv_secret == "given"
    monkeypatch.delenv("PDSERVE_KV_SECRET")
    with pytest.raises(RuntimeError, match="PDSERVE_KV_SECRET, which this node's environment"):
        kv_secret(KV_SECRET_FROM_ENV)
    drawn = {_bound_settings(build_app({"model": "tiny"})).kv_secret for _ in range(2)}
    assert len(drawn) == 2 and KV_SECRET_FROM_ENV not in drawn  # one per build


def _bound_settings(app: Any) -> RouterSettings:
    (settings,) = [a for a in app._bound_deployment.init_args if isinstance(a, RouterSettings)]
    return settings


@pytest.fixture
def http() -> TestClient:
    telemetry = RouterTelemetry()
    flow = SimpleNamespace(telemetry=telemetry, config=SimpleNamespace(limits=RequestLimits()))
    app = build_openai_app(lambda: flow, "tiny", 64, api_keys=ApiKeys.of(["k1", "k2"]))
    return TestClient(app)


def test_http_needs_a_key_on_every_route_but_health(http: TestClient) -> None:
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic k1"}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions")):
            response = http.request(method, path, headers=headers, json={"prompt": "hi"})
            assert response.status_code == 401
            assert response.headers["www-authenticate"] == "Bearer"
            error = response.json()["error"]
            assert error["code"] == "invalid_api_key"
            assert error["type"] == "invalid_request_error"
            assert error["message"] in (MISSING, WRONG)
            assert "nope" not in json.dumps(response.json())
    assert http.get("/health").status_code == 200
    # Under a route prefix (Serve's root_path) only the app's own /health is open.
    prefixed = TestClient(http.app, root_path="/app")
    assert prefixed.get("/app/health").status_code == 200
    assert prefixed.get("/app/v1/models").status_code == 401
    assert TestClient(http.app, root_path="/health").get("/health/v1/models").status_code == 401
    for key in ("k1", "k2"):
        response = http.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 200
        assert response.json()["data"][0]["id"] == "tiny"


def test_the_grpc_message_bound_is_set_while_ray_starts_and_checked() -> None:
    import os

    from deployments.launch import GRPC_MAX_MESSAGE_ENV, ServeOptions, proxy_environment

    before = os.environ.get(GRPC_MAX_MESSAGE_ENV)
    with proxy_environment(ServeOptions(grpc_max_message_bytes=1 << 20)):
        assert os.environ[GRPC_MAX_MESSAGE_ENV] == str(1 << 20)  # what Ray's processes inherit
    assert os.environ.get(GRPC_MAX_MESSAGE_ENV) == before
    for wrong in (0, 2**31):
        with pytest.raises(ValueError, match="grpc_max_message_bytes must be between"):
            ServeOptions(grpc_max_message_bytes=wrong)


def test_side_channel_tls_comes_from_a_cert_manager_secret_directory(monkeypatch) -> None:
    """The manifests mount cert-manager's Secret (tls.crt, tls.key, ca.crt) at one path on
    every pod and name it in the environment: every build binds mutual TLS from it."""
    monkeypatch.setenv("PDSERVE_SIDE_CHANNEL_TLS_DIR", "/etc/pdserve/engine-tls/")
    tls = _bound_settings(build_app({"model": "tiny"})).side_channel_tls
    assert tls is not None and tls.server_name == "pdserve-engine"
    assert (tls.certfile, tls.keyfile, tls.ca_certs) == tuple(
        f"/etc/pdserve/engine-tls/{name}" for name in ("tls.crt", "tls.key", "ca.crt")
    )
    engines = AppConfig.from_args({"model": "tiny"}).kv_transfer_config()["tls"]
    assert engines == {  # the engines' side channel: the same files
        "certfile": tls.certfile,
        "keyfile": tls.keyfile,
        "ca_certs": tls.ca_certs,
        "server_name": "pdserve-engine",
    }
    monkeypatch.setenv("PDSERVE_SIDE_CHANNEL_TLS_NAME", "engines.example")
    assert _bound_settings(build_app({"model": "tiny"})).side_channel_tls.server_name == (
        "engines.example"
    )
    monkeypatch.setenv("PDSERVE_SIDE_CHANNEL_TLS_DIR", "")
    with pytest.raises(ValueError, match="PDSERVE_SIDE_CHANNEL_TLS_DIR is set but empty"):
        build_app({"model": "tiny"})


def test_router_replicas_drain_their_streams_as_engines_do() -> None:
    """Serve's default (20 s) would cut a router's longer streams on every scale-down."""
    app = build_app({"model": "tiny", "request_timeout_s": 120})
    assert app._bound_deployment._deployment_config.graceful_shutdown_timeout_s == 120
