"""What drains and upgrades need of a RayService (tests/manifest_checks.py's rayservice_problems
runs these): worker pods that move their replicas before they stop, and upgrades that let the
old cluster's streams end and, incrementally, do not outrun the autoscalers."""

from __future__ import annotations

from typing import Any

GPU = "nvidia.com/gpu"
INCREMENTAL = "NewClusterWithIncrementalUpgrade"
UPGRADE_TYPES = ("NewCluster", "None", INCREMENTAL)
# KubeRay's guidance: a minute between traffic steps lets Serve start replicas and the Ray
# autoscaler their pods; much less and the traffic outruns the capacity.
MIN_UPGRADE_INTERVAL_S = 30


def upgrade_problems(spec: dict[str, Any], drain_s: float) -> list[str]:
    """The old cluster outlives its streams, and an incremental upgrade is one KubeRay can
    carry out: a Gateway class, traffic steps no larger than a capacity step, time between
    them, and the Ray autoscaler on (the capacity steps are Serve's target_capacity)."""
    problems = []
    deletion_delay = spec.get("rayClusterDeletionDelaySeconds", 60)
    if deletion_delay < drain_s:
        problems.append(
            f"rayClusterDeletionDelaySeconds {deletion_delay} < the engines' drain {drain_s:g} s:"
            " an upgrade cuts the old cluster's streams"
        )
    strategy = spec.get("upgradeStrategy") or {}
    kind = strategy.get("type", "NewCluster")
    if kind not in UPGRADE_TYPES:
        return [*problems, f"upgradeStrategy.type {kind!r} is none of {UPGRADE_TYPES}"]
    if kind != INCREMENTAL:
        return problems
    options = strategy.get("clusterUpgradeOptions") or {}
    surge = options.get("maxSurgePercent", 100)
    step = options.get("stepSizePercent", 0)
    if not options.get("gatewayClassName"):
        problems.append("incremental upgrade without a gatewayClassName")
    if not 0 < step <= surge <= 100:
        problems.append(
            f"incremental upgrade steps: need 0 < stepSizePercent ({step}) <= maxSurgePercent "
            f"({surge}) <= 100"
        )
    if options.get("intervalSeconds", 0) < MIN_UPGRADE_INTERVAL_S:
        problems.append(
            f"incremental upgrade intervalSeconds under {MIN_UPGRADE_INTERVAL_S}: traffic "
            "would outrun the autoscalers"
        )
    if not spec["rayClusterConfig"].get("enableInTreeAutoscaling"):
        problems.append("incremental upgrade without the Ray autoscaler: capacity never moves")
    return problems


def drain_problems(group: dict[str, Any]) -> list[str]:
    """A worker pod moves its replicas before it stops (`pdserve drain-node` as preStop,
    within the grace period), and asks for the disk its emptyDir volumes take."""
    pod = group["template"]["spec"]
    ray = pod["containers"][0]
    command = ray.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    problems = []
    if command[:2] != ["pdserve", "drain-node"]:
        problems.append("no preStop running `pdserve drain-node`: an eviction kills streams")
    else:
        deadline = float(command[command.index("--deadline-s") + 1])
        if deadline >= pod.get("terminationGracePeriodSeconds", 30):
            problems.append(f"drain deadline {deadline:g} s >= terminationGracePeriodSeconds")
    scratch = {v["name"] for v in pod.get("volumes", []) if "emptyDir" in v}
    for container in pod.get("initContainers", []) + pod["containers"]:
        mounted = {m["name"] for m in container.get("volumeMounts", [])}
        requests = container.get("resources", {}).get("requests", {})
        if mounted & scratch and "ephemeral-storage" not in requests:
            problems.append(f"container {container['name']}: no ephemeral-storage request")
    if GPU in ray.get("resources", {}).get("limits", {}) and not pod.get(
        "topologySpreadConstraints"
    ):
        problems.append("GPU pods without topologySpreadConstraints")
    return problems
