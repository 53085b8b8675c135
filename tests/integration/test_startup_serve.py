"""A request that arrives before any engine can answer it, on real Serve: the Router runs, the
engine replicas wait for GPU nodes that have not joined (here: for GPUs this machine does not
have, the same pending state in Ray). The request must be refused at once and clearly —
UNAVAILABLE / HTTP 503 with Retry-After — not held until a replica starts; health says the app
is not serving."""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import pytest

from pdserve.client import generate_request
from tests.integration.serving import AppSettings, ServeCluster, ServedApp, running_replicas
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

# Long enough that a held request would show as a timeout here, not as an answer.
CALL_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def pending(serve_cluster: ServeCluster) -> Iterator[ServedApp]:
    settings = AppSettings(
        app={
            "model": "tiny",
            "engine_args": {"max_model_len": 256, "kv_cache_memory_bytes": 16 << 20},
            "num_gpus_per_engine": 1.0,  # no GPU here: the engine replicas stay pending
            "retry_after_s": 3,
            # Serve stops a replica that never started as it stops a running one: it waits
            # out the graceful shutdown period (this) before killing it.
            "request_timeout_s": 10,
        }
    )
    with serve_cluster.serving(settings, wait=False) as served:
        assert wait_until(lambda: running_replicas("Router") == 1, 120)
        yield served


def test_http_is_refused_at_once_with_503_and_retry_after(pending: ServedApp) -> None:
    conn = pending.connection(timeout=CALL_TIMEOUT_S)
    body = json.dumps({"prompt": "hello", "max_tokens": 4})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    error = json.loads(response.read())["error"]
    conn.close()
    assert response.status == 503
    assert response.getheader("Retry-After") == "3"
    assert error["type"] == "server_error" and error["code"] == 503
    assert "no engine replica is running yet" in error["message"]
    assert "retry after 3 s" in error["message"]
    assert running_replicas("DecodeServer") == 0  # still none: refused, not served late


def test_grpc_is_refused_at_once_with_unavailable(pending: ServedApp) -> None:
    request = generate_request("hello", max_tokens=4)
    with pytest.raises(grpc.RpcError) as refused:
        pending.client.complete(request, timeout=CALL_TIMEOUT_S)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    details = refused.value.details() or ""
    assert "no engine replica is running yet" in details and "retry after 3 s" in details
    assert "SERVE_REPLICA" not in details and "Traceback" not in details


def test_health_says_not_serving(pending: ServedApp) -> None:
    assert pending.client.health().status == "NOT_SERVING"
    conn = pending.connection(timeout=CALL_TIMEOUT_S)
    conn.request("GET", "/health")
    response = conn.getresponse()
    report = json.loads(response.read())
    conn.close()
    assert response.status == 503 and report["status"] == "NOT_SERVING"
