"""SLA autoscaling on real local Ray Serve: under load past its targets the decode deployment
grows from one replica to two, and back to one once the load is gone. Serve's controller runs
deployments/cluster/sla_autoscaling.py's policy on what the engine replicas record."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.client import GenerationClient, generate_request
from tests.integration.serving import AppSettings, ServeCluster, running_replicas
from tests.waiting import wait_until

pytestmark = [
    pytest.mark.integration,
    # Serve warns on every read of a config that sets it (see metrics_interval_s below).
    pytest.mark.filterwarnings("ignore:The `metrics_interval_s` field:DeprecationWarning"),
]

SLA = {
    "running_requests": 2,  # a decode replica running more than two is over target
    "min_replicas": 1,
    "max_replicas": 2,
    "upscale_delay_s": 0,
    "downscale_delay_s": 3,
    # Replicas report every second, not every ten: the test waits on seconds, not tens.
    "metrics_interval_s": 1,
    "look_back_period_s": 3,
}


SETTINGS = AppSettings(
    app={
        "model": "tiny",
        "engine_args": {"max_model_len": 256, "kv_cache_memory_bytes": 16 << 20},
        "num_cpus_per_engine": 0.5,
        "transport": "nixl",
        "sla_autoscaling": SLA,
    }
)


@pytest.fixture(scope="module")
def client(serve_cluster: ServeCluster) -> Iterator[GenerationClient]:
    with serve_cluster.serving(SETTINGS) as served:
        yield served.client


def test_decode_scales_one_to_two_under_load_and_back(client: GenerationClient) -> None:
    assert running_replicas("DecodeServer") == 1
    done = threading.Event()

    def load(i: int) -> int:
        sent = 0
        while not done.is_set():
            request = generate_request(f"Load {i}", max_tokens=200, ignore_eos=True)
            client.complete(request, timeout=120)
            sent += 1
        return sent

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(load, i) for i in range(8)]
        try:
            assert wait_until(lambda: running_replicas("DecodeServer") == 2, 120)
        finally:
            done.set()
        assert all(f.result() >= 1 for f in futures)
    assert wait_until(lambda: running_replicas("DecodeServer") == 1, 120)
