"""API keys (deployments/api_keys.py): where keys come from, what a caller must send, and the
HTTP side through the real FastAPI app (Starlette's test client; the Serve and gRPC sides run
in tests/integration/test_security_serve.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from deployments.api_keys import MISSING, WRONG, ApiKeys, configured_keys, without_credentials
from deployments.app import AppConfig, build_app
from deployments.openai_api import build_openai_app
from deployments.protocol import RequestLimits
from deployments.router import RouterSettings
from deployments.telemetry import RouterTelemetry


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


def test_the_router_gets_digests_never_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_API_KEY", "from-env")
    monkeypatch.setenv("PDSERVE_KV_SECRET", "shared-secret")
    app = build_app({"model": "tiny", "api_key": ["from-args"]})
    settings = _bound_settings(app)
    assert settings.api_keys == ApiKeys.of(["from-args", "from-env"])
    assert settings.api_keys.refusal("Bearer from-env") is None
    assert settings.kv_secret == "shared-secret"  # every build of the app agrees on it
    text = repr(settings)
    assert "from-args" not in text and "from-env" not in text


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
    for key in ("k1", "k2"):
        response = http.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 200
        assert response.json()["data"][0]["id"] == "tiny"
