"""Credentials (deployments/credentials.py): where API keys and the KV secret come from, what a
caller must send, what the replicas are given, and the HTTP side through the real FastAPI app
(Starlette's test client; the Serve and gRPC sides run in
tests/integration/test_security_serve.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from deployments.app import AppConfig, build_app
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
