"""One Serve app for every module of this package: the disaggregated app ("pdserve") and the
colocated one ("colocated") beside it, deployed once (starting four engine replicas takes most
of a minute on 2 cores) and deleted after the package's last test. The modules run in name
order; test_replica_kills.py, which kills replicas, sorts last."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine.llm import LLM
from tests.integration.serve_app.shared import ENGINE_ARGS, SETTINGS
from tests.integration.serving import ServeCluster, ServedApp


@pytest.fixture(scope="package")
def app(serve_cluster: ServeCluster) -> Iterator[ServedApp]:
    with serve_cluster.serving(SETTINGS) as served:
        yield served


@pytest.fixture(scope="package")
def offline() -> Iterator[LLM]:
    llm = LLM("tiny", **ENGINE_ARGS)
    yield llm
    llm.close()
