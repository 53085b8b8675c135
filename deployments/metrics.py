"""Prometheus metrics as an SRE's alerts read them (the router's and the engines' own are in
deployments/router/telemetry.py and deployments/replica/telemetry.py).

- Every series exists from start-up. An alert on `rate(ray_pdserve_requests_total{outcome=
  "error"}[5m])` or on KV checksum failures must read 0 on a healthy app, not "no data" until
  the first failure. So each counter is recorded at 0 for every tag value known up front
  (outcomes, transports, sides) and each gauge set to 0 when the replica starts. Histograms
  cannot be: Ray creates a histogram's series with its first observation.
- No label of ours changes when a replica restarts. Serve's metrics API tags every series with
  the replica's id, new on each restart, so every restart would begin new series for each
  metric. Ours carry the application, the deployment and the replica's *rank*: Serve's ordinal
  of the replica within its deployment (0..N-1), which a replacement takes over (read when the
  replica starts: after a scale-down Serve may renumber running replicas, which keep the rank
  they started with). Ray's own per-process labels are another matter: see
  k8s/monitoring.yaml.

Ray's metric classes are used directly (`ray.util.metrics`), created lazily: the modules import
without Ray running, and outside a Serve replica (tests, local use) the identity tags are empty.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

IDENTITY_TAGS = ("application", "deployment", "rank")


def replica_identity() -> dict[str, str]:
    """This replica's stable labels; empty values outside a Serve replica."""
    try:
        from ray import serve

        context = serve.get_replica_context()
    except Exception:  # not in a replica (RayServeException), or Serve not importable
        return dict.fromkeys(IDENTITY_TAGS, "")
    return {
        "application": context.app_name,
        "deployment": context.deployment,
        "rank": str(context.rank.rank),  # Serve's ReplicaRank
    }


class ReplicaMetrics:
    """Makes one replica's metrics: the identity tags on every series, and counters and gauges
    at 0 from the start."""

    def __init__(self, identity: Mapping[str, str] | None = None) -> None:
        self.identity = dict(identity if identity is not None else replica_identity())

    def counter(
        self,
        name: str,
        description: str,
        tag_keys: Sequence[str] = (),
        start: Iterable[Mapping[str, str]] = ({},),
    ) -> Any:
        """A counter whose series for each tag set of `start` exist at 0 from now on."""
        from ray.util import metrics

        counter = self._tagged(metrics.Counter(name, description, self._keys(tag_keys)))
        for tags in start:
            # Ray's public inc() refuses 0 ("must be >0"); _record is what inc() calls after
            # that check, and a record of 0 is exactly "this series exists, at 0". Pinned by
            # tests/unit/test_metrics.py, should a Ray upgrade change it.
            counter._record(0, dict(tags))
        return counter

    def gauge(self, name: str, description: str) -> Any:
        from ray.util import metrics

        gauge = self._tagged(metrics.Gauge(name, description, self._keys(())))
        gauge.set(0)
        return gauge

    def histogram(
        self, name: str, description: str, boundaries: list[float], tag_keys: Sequence[str] = ()
    ) -> Any:
        from ray.util import metrics

        histogram = metrics.Histogram(name, description, boundaries, self._keys(tag_keys))
        return self._tagged(histogram)

    def _keys(self, tag_keys: Sequence[str]) -> tuple[str, ...]:
        return IDENTITY_TAGS + tuple(tag_keys)

    def _tagged(self, metric: Any) -> Any:
        return metric.set_default_tags(self.identity)


def each(key: str, values: Iterable[str]) -> list[dict[str, str]]:
    """Tag sets for `start`: one per value of one tag."""
    return [{key: value} for value in values]
