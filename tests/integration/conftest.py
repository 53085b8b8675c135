"""The Serve harness's fixtures (tests/integration/serving.py) and the order it needs.

A module that serves an app asks for `serve_cluster` and deploys its AppSettings with
`serve_cluster.serving(...)` in a module fixture (or a package fixture, shared by the modules
of tests/integration/serve_app/). Every such test runs after the integration tests that start
no Ray here, and those whose proxies speak TLS run last: so Ray and Serve start once for the
plain proxies and once for TLS, and are stopped as soon as the next test needs neither (the
model tests want the cores).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import RAY_TESTS
from tests.integration.serving import ServeCluster

HERE = Path(__file__).parent
_CLUSTER = pytest.StashKey[ServeCluster]()
# Modules that start a Ray of their own (`pdserve serve`).
_OWN_RAY = {"test_serve_cli.py"}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "proxy_tls: serves over TLS proxies (a Ray of its own; runs last)"
    )


def _cluster_group(item: pytest.Item) -> int:
    """0: starts no Ray here; 1: on the harness's Ray; 2: on its Ray with TLS proxies."""
    if "serve_cluster" not in item.fixturenames:
        return 0
    return 2 if item.get_closest_marker("proxy_tls") else 1


def pytest_itemcollected(item: pytest.Item) -> None:
    """A test that starts Ray must be one of tests/conftest.py's RAY_TESTS: under `make
    test`'s two workers those run on one, and two Rays at once would share the machine's two
    cores between two Serve apps (and their timeouts)."""
    starts_ray = _cluster_group(item) or item.path.name in _OWN_RAY
    if starts_ray and not item.nodeid.startswith(RAY_TESTS):
        raise pytest.UsageError(f"{item.nodeid} starts Ray: list it in tests/conftest.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Reorder the integration tests by cluster group, in place (a stable sort: each module's
    tests, and the modules of a group, keep their order)."""
    where = [i for i, item in enumerate(items) if item.path.is_relative_to(HERE)]
    ordered = sorted((items[i] for i in where), key=_cluster_group)
    for i, item in zip(where, ordered, strict=True):
        items[i] = item


@pytest.fixture(scope="session")
def serve_cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServeCluster]:
    environment = {
        # Engines that pin cores (1 CPU each, test_kv_routing.py) claim them in a directory of
        # this session's: no other pdserve on the machine holds them.
        "PDSERVE_CORE_LOCK_DIR": str(tmp_path_factory.mktemp("cores")),
    }
    cluster = ServeCluster(environment)
    request.config.stash[_CLUSTER] = cluster
    yield cluster
    cluster.stop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Once the fixtures the next test does not share are gone: stop Ray and Serve when the
    next test does not serve an app (it starts again, lazily, for one that does)."""
    result = yield
    cluster = item.config.stash.get(_CLUSTER, None)
    if cluster is not None and (nextitem is None or _cluster_group(nextitem) == 0):
        cluster.stop()
    return result
