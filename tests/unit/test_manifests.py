"""The Kubernetes files as shipped (k8s/, the Dockerfile, deployments/serve_config.yaml) pass
every check of tests/manifest_checks.py, and broken copies of them fail the check that guards
each mistake: a gRPC port KubeRay would not route, an unknown field, a wrong enum value,
autoscaling or secrets in `args`, a deployment override naming no deployment, ..."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from tests.manifest_checks import (
    K8S,
    KUBERAY_SCHEMA,
    PODMONITOR_SCHEMA,
    ROOT,
    core_problems,
    crd_problems,
    documents,
    kustomize,
    rayservice_problems,
    serve_config_problems,
)

OVERLAYS = sorted(path.parent.name for path in (K8S / "overlays").glob("*/kustomization.yaml"))


def the_rayservice(resources: list[dict[str, Any]]) -> dict[str, Any]:
    (rayservice,) = [r for r in resources if r["kind"] == "RayService"]
    return rayservice


@pytest.fixture
def rayservice() -> dict[str, Any]:
    resource = the_rayservice(kustomize(K8S / "base"))
    assert [resource] == documents(K8S / "base" / "rayservice.yaml")
    return resource


def overlaid(name: str) -> dict[str, Any]:
    return the_rayservice(kustomize(K8S / "overlays" / name))


def serve_config(rayservice: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])


def with_serve_config(rayservice: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    rayservice["spec"]["serveConfigV2"] = yaml.safe_dump(config)
    return rayservice


def head(rayservice: dict[str, Any]) -> dict[str, Any]:
    return rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]


def gpu_pod(rayservice: dict[str, Any]) -> dict[str, Any]:
    return rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]


def test_the_shipped_files_pass_every_check(rayservice: dict[str, Any]) -> None:
    assert crd_problems(rayservice, KUBERAY_SCHEMA) == []
    assert rayservice_problems(rayservice) == []
    assert serve_config_problems(serve_config(rayservice)) == []
    local = yaml.safe_load((ROOT / "deployments" / "serve_config.yaml").read_text())
    assert serve_config_problems(local) == []
    (monitor,) = documents(K8S / "monitoring.yaml")
    assert crd_problems(monitor, PODMONITOR_SCHEMA) == []
    tracing = documents(K8S / "tracing.yaml")
    assert {doc["kind"] for doc in tracing} == {"ConfigMap", "Deployment", "Service"}
    for doc in tracing:
        assert core_problems(doc) == [], doc["metadata"]["name"]


def test_disruption_budgets_select_each_worker_group_one_pod_at_a_time(
    rayservice: dict[str, Any],
) -> None:
    budgets = [r for r in kustomize(K8S / "base") if r["kind"] == "PodDisruptionBudget"]
    groups = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert len(budgets) == len(groups)
    by_group = {b["spec"]["selector"]["matchLabels"]["ray.io/group"]: b for b in budgets}
    for group in groups:
        budget = by_group[group["groupName"]]
        assert core_problems(budget) == []
        # An integer minAvailable: KubeRay's RayCluster has no scale subresource, and
        # Kubernetes allows no eviction at all under maxUnavailable or a percentage then.
        assert set(budget["spec"]) == {"minAvailable", "selector"}
        assert budget["spec"]["minAvailable"] == group["minReplicas"] - 1 >= 1
        selector = budget["spec"]["selector"]["matchLabels"]
        # KubeRay labels a worker pod with its group; the template carries the rest.
        pod_labels = {**group["template"]["metadata"]["labels"], "ray.io/group": group["groupName"]}
        assert selector.items() <= pod_labels.items()


# ------------------------------------------------------------------------ broken copies


def _rename_grpc_port(rs: dict[str, Any]) -> None:
    (port,) = [p for p in head(rs)["containers"][0]["ports"] if p["containerPort"] == 9000]
    port["name"] = "grpc"


def _drop_h2c(rs: dict[str, Any]) -> None:
    for port in rs["spec"]["serveService"]["spec"]["ports"]:
        port.pop("appProtocol", None)


def _autoscaling_in_args(rs: dict[str, Any]) -> None:
    config = serve_config(rs)
    config["applications"][0]["args"]["decode_autoscaling"] = {"min_replicas": 1, "max_replicas": 3}
    with_serve_config(rs, config)


def _secret_in_args(rs: dict[str, Any]) -> None:
    config = serve_config(rs)
    config["applications"][0]["args"]["kv_secret"] = "0123abcd"
    with_serve_config(rs, config)


def _secret_env_literal(rs: dict[str, Any]) -> None:
    gpu_pod(rs)["containers"][0]["env"][0] = {"name": "PDSERVE_KV_SECRET", "value": "literal"}


def _requests_below_limits(rs: dict[str, Any]) -> None:
    gpu_pod(rs)["containers"][0]["resources"]["requests"]["cpu"] = "4"


def _short_grace(rs: dict[str, Any]) -> None:
    gpu_pod(rs)["terminationGracePeriodSeconds"] = 30


def _no_toleration(rs: dict[str, Any]) -> None:
    gpu_pod(rs).pop("tolerations")


def _no_autoscaler(rs: dict[str, Any]) -> None:
    rs["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] = False


def _model_not_fetched(rs: dict[str, Any]) -> None:
    gpu_pod(rs).pop("initContainers")


def _writable_shared_claim(rs: dict[str, Any]) -> None:
    gpu_pod(rs)["volumes"][0] = {"name": "models", "persistentVolumeClaim": {"claimName": "m"}}


def _short_deletion_delay(rs: dict[str, Any]) -> None:
    rs["spec"].pop("rayClusterDeletionDelaySeconds")


def _https_behind_kuberay_probes(rs: dict[str, Any]) -> None:
    config = serve_config(rs)
    config["http_options"].update(ssl_keyfile="/tls/tls.key", ssl_certfile="/tls/tls.crt")
    with_serve_config(rs, config)


def _api_key_in_env(rs: dict[str, Any]) -> None:
    ref = {"secretKeyRef": {"name": "pdserve-secrets", "key": "api-keys"}}
    gpu_pod(rs)["containers"][0]["env"].append({"name": "PDSERVE_API_KEY", "valueFrom": ref})


def _key_file_by_sub_path(rs: dict[str, Any]) -> None:
    (mount,) = [m for m in head(rs)["containers"][0]["volumeMounts"] if m["name"] == "api-keys"]
    mount.update(mountPath="/etc/pdserve/api-keys/keys", subPath="keys")


def _no_key_file(rs: dict[str, Any]) -> None:
    env = gpu_pod(rs)["containers"][0]["env"]
    env[:] = [e for e in env if e["name"] != "PDSERVE_API_KEY_FILE"]


def _unbounded_grpc(rs: dict[str, Any]) -> None:
    env = head(rs)["containers"][0]["env"]
    env[:] = [e for e in env if e["name"] != "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"]


def _no_pre_stop(rs: dict[str, Any]) -> None:
    gpu_pod(rs)["containers"][0].pop("lifecycle")


def _drain_past_grace(rs: dict[str, Any]) -> None:
    gpu_pod(rs)["terminationGracePeriodSeconds"] = 300


def _no_disk_request(rs: dict[str, Any]) -> None:
    for part in ("limits", "requests"):
        gpu_pod(rs)["initContainers"][0]["resources"][part].pop("ephemeral-storage")


def _no_spread(rs: dict[str, Any]) -> None:
    gpu_pod(rs).pop("topologySpreadConstraints")


def _engine_overrides(rs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    config = serve_config(rs)
    return config, {d["name"]: d for d in config["applications"][0]["deployments"]}


def _router_anywhere(rs: dict[str, Any]) -> None:
    config, overrides = _engine_overrides(rs)
    overrides["Router"].pop("ray_actor_options")
    with_serve_config(rs, config)


def _router_resource_nowhere(rs: dict[str, Any]) -> None:
    rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][1].pop("resources")


def _fixed_prefill(rs: dict[str, Any]) -> None:
    config, overrides = _engine_overrides(rs)
    overrides["PrefillServer"].pop("autoscaling_config")
    overrides["PrefillServer"]["num_replicas"] = 1
    with_serve_config(rs, config)


def _no_headroom(rs: dict[str, Any]) -> None:
    rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplicas"] = 5


def _revision_unpinned(rs: dict[str, Any]) -> None:
    command = gpu_pod(rs)["initContainers"][0]["command"]
    command[command.index("--revision") + 1] = "main"


SEMANTIC_BREAKS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "model revision a branch": (_revision_unpinned, "fetch-model: --revision main is not a commit"),
    "no preStop drain": (_no_pre_stop, "gpu: no preStop running `pdserve drain-node`"),
    "drain past the grace period": (_drain_past_grace, "drain deadline 300 s >="),
    "no ephemeral-storage request": (_no_disk_request, "fetch-model: no ephemeral-storage"),
    "GPU pods not spread": (_no_spread, "without topologySpreadConstraints"),
    "routers on GPU pods": (_router_anywhere, "Router replicas may land on GPU pods"),
    "router resource on no pod": (_router_resource_nowhere, "no worker group advertises"),
    "prefill fixed": (_fixed_prefill, "PrefillServer is not under the SLA autoscaling policy"),
    "GPU pool without headroom": (_no_headroom, "maxReplicas 5 leaves no headroom"),
    "API keys in the environment": (_api_key_in_env, "gpu: PDSERVE_API_KEY in the environment"),
    "key file through subPath": (_key_file_by_sub_path, "head: PDSERVE_API_KEY_FILE"),
    "no key file": (_no_key_file, "gpu: no PDSERVE_API_KEY_FILE"),
    "gRPC messages unbounded": (_unbounded_grpc, "head: RAY_SERVE_GRPC_MAX_MESSAGE_SIZE unset"),
    "gRPC port renamed back to grpc": (_rename_grpc_port, "named 'grpc'"),
    "gRPC port without h2c": (_drop_h2c, "h2c"),
    "autoscaling in args": (_autoscaling_in_args, "decode_autoscaling is in args"),
    "kv_secret in args": (_secret_in_args, "kv_secret is in args"),
    "secret as a literal": (_secret_env_literal, "PDSERVE_KV_SECRET does not come from a Secret"),
    "requests below limits": (_requests_below_limits, "requests differ from limits"),
    "grace below the drain": (_short_grace, "terminationGracePeriodSeconds 30"),
    "no GPU toleration": (_no_toleration, "toleration"),
    "in-tree autoscaling off": (_no_autoscaler, "enableInTreeAutoscaling"),
    "model never fetched": (_model_not_fetched, "nothing puts it there"),
    "shared writable claim": (_writable_shared_claim, "readOnly"),
    "old cluster deleted mid-stream": (_short_deletion_delay, "rayClusterDeletionDelaySeconds 60"),
    "HTTPS behind plain-HTTP probes": (_https_behind_kuberay_probes, "they speak plain HTTP"),
}


@pytest.mark.parametrize("name", SEMANTIC_BREAKS)
def test_each_semantic_mistake_is_caught(rayservice: dict[str, Any], name: str) -> None:
    breaks, expected = SEMANTIC_BREAKS[name]
    broken = copy.deepcopy(rayservice)
    breaks(broken)
    problems = rayservice_problems(broken)
    assert any(expected in problem for problem in problems), problems


@pytest.mark.parametrize(
    ("where", "field", "value", "expected"),
    [
        (["spec"], "serveConfigV3", "x", "Additional properties"),
        (
            ["spec", "rayClusterConfig", "headGroupSpec", "template", "spec"],
            "gpus",
            1,
            "Additional",
        ),
        (
            ["spec", "rayClusterConfig", "autoscalerOptions"],
            "upscalingMode",
            "Eager",
            "is not one of",
        ),
        (["spec", "rayClusterConfig", "authOptions"], "mode", "password", "is not one of"),
        (["spec", "rayClusterConfig", "workerGroupSpecs", 0], "maxReplicas", "four", "integer"),
    ],
)
def test_the_crd_schema_refuses_unknown_fields_and_wrong_values(
    rayservice: dict[str, Any], where: list[Any], field: str, value: Any, expected: str
) -> None:
    node = rayservice
    for key in where:
        node = node[key]
    node[field] = value
    problems = crd_problems(rayservice, KUBERAY_SCHEMA)
    assert any(expected in problem for problem in problems), problems


def test_core_objects_refuse_unknown_fields_wrong_types_and_kinds() -> None:
    """Kubernetes' own schemas carry no enums for core fields (the API server checks those in
    code), so the wrong values here are of the wrong type, or of a kind no API serves."""
    deployment = next(d for d in documents(K8S / "tracing.yaml") if d["kind"] == "Deployment")
    unknown = copy.deepcopy(deployment)
    unknown["spec"]["template"]["spec"]["containers"][0]["gpus"] = 1
    assert any("'gpus' was unexpected" in p for p in core_problems(unknown))
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["replicas"] = "one"
    assert any("spec/replicas" in p for p in core_problems(wrong_type))
    retired = copy.deepcopy(deployment)
    retired["apiVersion"] = "extensions/v1beta1"
    assert any("Couldn't find schema" in p for p in core_problems(retired))


def test_serve_config_mistakes_are_caught(rayservice: dict[str, Any]) -> None:
    config = serve_config(rayservice)
    renamed = copy.deepcopy(config)
    renamed["applications"][0]["deployments"][1]["name"] = "Decoder"
    assert any("'Decoder' does not exist" in p for p in serve_config_problems(renamed))
    unknown_arg = copy.deepcopy(config)
    unknown_arg["applications"][0]["args"]["prefil_replicas"] = 2
    assert any("prefil_replicas" in p for p in serve_config_problems(unknown_arg))
    bad_option = copy.deepcopy(config)
    bad_option["applications"][0]["deployments"][1]["autoscaling_config"]["max_replicas"] = -1
    assert serve_config_problems(bad_option)
    bad_schema = copy.deepcopy(config)
    bad_schema["proxy_location"] = "Everywhere"
    assert any("ServeDeploySchema" in p for p in serve_config_problems(bad_schema))


def test_podmonitor_scrapes_the_rayservice_pods(rayservice: dict[str, Any]) -> None:
    (monitor,) = documents(K8S / "monitoring.yaml")
    wanted = monitor["spec"]["selector"]["matchLabels"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    cluster = rayservice["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        labels = {"ray.io/is-ray-node": "yes", **group["template"]["metadata"]["labels"]}
        assert wanted.items() <= labels.items()
        ports = {
            p["name"]: p["containerPort"]
            for p in group["template"]["spec"]["containers"][0]["ports"]
        }
        assert str(ports[endpoint["port"]]) == group["rayStartParams"]["metrics-export-port"]


def test_traces_go_where_the_dashboard_reads_them(rayservice: dict[str, Any]) -> None:
    import json

    endpoint = serve_config(rayservice)["applications"][0]["args"]["otlp_endpoint"]
    host, port = re.fullmatch(r"http://([\w.-]+):(\d+)", endpoint).groups()  # type: ignore[union-attr]
    services = {
        d["metadata"]["name"]: d for d in documents(K8S / "tracing.yaml") if d["kind"] == "Service"
    }
    assert int(port) in {p["port"] for p in services[host]["spec"]["ports"]}
    dashboard = json.loads((K8S / "dashboards" / "pdserve.json").read_text())
    trace_panels = [p for p in dashboard["panels"] if p["datasource"]["type"] != "prometheus"]
    assert trace_panels and {p["datasource"]["type"] for p in trace_panels} == {"tempo"}
    assert "jaeger" not in json.dumps(dashboard).lower()


# ------------------------------------------------------------------------ the image

SYNTAX_DIRECTIVE = re.compile(r"^\s*#\s*syntax\s*=", re.I)
BUILDKIT_ONLY = [
    (r"--mount[= ]", "RUN --mount"),
    (r"--link\b", "COPY --link"),
    (r"--chmod[= ]", "COPY --chmod"),
    (r"--exclude[= ]", "COPY --exclude"),
    (r"<<-?\s*['\"]?[A-Z]", "a heredoc"),
]


def dockerfile_problems(text: str) -> list[str]:
    """Syntax the classic builder does not know, and a WORKDIR the image's user cannot write
    (the classic builder creates it as root)."""
    lines = [line for line in text.splitlines() if line.strip()]
    problems = ["a # syntax= directive" for line in lines if SYNTAX_DIRECTIVE.match(line)]
    code = [line for line in lines if not line.lstrip().startswith("#")]
    problems += [
        what for pattern, what in BUILDKIT_ONLY for line in code if re.search(pattern, line)
    ]
    instructions = [[*line.split(None, 1), ""][:2] for line in code]
    workdirs = [i for i, (op, _) in enumerate(instructions) if op.upper() == "WORKDIR"]
    for index in workdirs:
        directory = instructions[index][1].strip()
        owned = any(
            op.upper() == "RUN" and re.search(rf"chown\s+\S+\s+{re.escape(directory)}\b", rest)
            for op, rest in instructions[:index]
        )
        if not owned:
            problems.append(f"WORKDIR {directory} is created as root")
    return problems


def test_the_dockerfile_builds_without_buildkit() -> None:
    """No Docker daemon on the test machines: the check is on the Dockerfile's text."""
    text = (ROOT / "Dockerfile").read_text()
    assert dockerfile_problems(text) == []
    pin = re.search(r'"torch==([\d.]+)"', (ROOT / "pyproject.toml").read_text())
    assert pin and f"torch=={pin.group(1)}" in text
    old = "FROM rayproject/ray:2.60.0-py311-gpu\nWORKDIR /app\nCOPY --chown=ray:users . .\n"
    assert dockerfile_problems(old) == ["WORKDIR /app is created as root"]
    heredoc = text + "RUN <<EOF\necho hi\nEOF\nCOPY --link a b\n"
    assert set(dockerfile_problems(heredoc)) == {"a heredoc", "COPY --link"}


def test_the_scrape_drops_rays_per_session_labels_and_keeps_what_tells_series_apart() -> None:
    """A series as Ray exports pdserve's (the labels of a real scrape, values made up): after
    the PodMonitor's rules no label changes when the Ray container restarts, and what tells
    two processes' series apart (WorkerId: Ray keeps a dead process's counters) is kept."""
    from tests.prometheus_relabel import monitor_rules, relabel

    (monitor,) = documents(K8S / "monitoring.yaml")
    exported = {
        "Component": "core_worker",
        "NodeAddress": "10.0.3.7",
        "SessionName": "session_2026-11-27_22-05-35_999043_15663",
        "Version": "2.60.0",
        "WorkerId": "96442fc6aa143c841b312a841d197dca067f07f7c52569600ce8c3e6",
        "otel_scope_name": "ray._private.telemetry.open_telemetry_metric_recorder",
        "otel_scope_schema_url": "",
        "otel_scope_version": "",
        "application": "pdserve",
        "deployment": "DecodeServer",
        "rank": "0",
        "outcome": "ok",
    }
    kept = relabel(exported, monitor_rules(monitor))
    assert set(kept) == {
        "Component",
        "NodeAddress",
        "WorkerId",
        "application",
        "deployment",
        "rank",
        "outcome",
    }
