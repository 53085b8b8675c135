"""Prometheus's metric relabelling, for the actions k8s/monitoring.yaml uses: the tests apply
the shipped rules to a real scrape of Ray's endpoint. An action this does not model fails the
test, rather than passing unapplied."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

Series = tuple[str, frozenset[tuple[str, str]]]  # name, labels


def relabel(labels: Mapping[str, str], rules: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """`labels` after `rules` (PodMonitor metricRelabelings)."""
    out = dict(labels)
    for rule in rules:
        action = rule.get("action", "replace")
        if action != "labeldrop":
            raise NotImplementedError(f"relabel action {action!r} is not modelled here")
        # Prometheus anchors the regex at both ends.
        pattern = re.compile(f"^(?:{rule['regex']})$")
        out = {k: v for k, v in out.items() if not pattern.match(k)}
    return out


def monitor_rules(monitor: Mapping[str, Any]) -> list[dict[str, Any]]:
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    return list(endpoint.get("metricRelabelings", []))
