"""Checks of the Kubernetes files under k8s/ (tests/unit/test_manifests.py runs them on the files
as shipped, and on broken copies to show each check can fail).

Each check returns the problems it found (empty: fine), so a test can assert both ways:
- `crd_problems`: a custom resource against its CRD's vendored OpenAPI schema (k8s/schemas),
  strictly: an unknown field is a problem, as with `kubectl apply --validate=strict`.
- `core_problems`: a core object against Kubernetes' own schema (kubernetes-validate, strict).
- `serve_config_problems`: the serve config through Ray's ServeDeploySchema, then through what
  Serve does when it deploys it: build_app with the config's args, then the config's
  `deployments:` overrides applied to the built deployments (Serve's own function).
- `rayservice_problems`: what a RayService needs beyond its schema to work as shipped.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from tests.manifest_lifecycle import GPU, drain_problems, upgrade_problems

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
KUBERAY_SCHEMA = K8S / "schemas" / "kuberay-v1.7.0-rayservice-v1.json"
PODMONITOR_SCHEMA = K8S / "schemas" / "prometheus-operator-v0.93.0-podmonitor-v1.json"
KUBERNETES_VERSION = "1.33.0"
SECRET_ENV = ("PDSERVE_KV_SECRET",)
KEY_FILE_ENV = "PDSERVE_API_KEY_FILE"
GRPC_MESSAGE_ENV = "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"
TLS_DIR_ENV = "PDSERVE_SIDE_CHANNEL_TLS_DIR"
GRPC_MESSAGE_LIMIT = 64 << 20  # what a gRPC proxy may take before the key is checked
SECRETS_IN_ARGS = ("kv_secret", "api_key")
AUTOSCALING_IN_ARGS = ("prefill_autoscaling", "decode_autoscaling", "sla_autoscaling")


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """What the real kustomize makes of a kustomization: `kubectl kustomize DIRECTORY`
    (kubectl 1.32 carries kustomize 5.5), its documents parsed. ValueError with kustomize's
    own message where it refuses (a cycle, a patch that matches nothing, an unknown field)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise RuntimeError(
            "kubectl is not on PATH: the manifest tests render k8s/ with the real kustomize "
            "(`kubectl kustomize`, kubectl 1.32 or later)"
        )
    done = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120
    )
    if done.returncode != 0:
        raise ValueError(done.stderr.strip())
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


# ------------------------------------------------------------------------ schemas


def crd_problems(resource: dict[str, Any], schema_path: Path) -> list[str]:
    validator = jsonschema.Draft7Validator(_strict_schema(schema_path))
    return [_where(error) for error in validator.iter_errors(resource)]


@cache
def _strict_schema(schema_path: Path) -> dict[str, Any]:
    return _strict(json.loads(schema_path.read_text()))


def _strict(node: Any) -> Any:
    """The schema with unknown fields refused wherever the CRD lists the fields (the API
    server's strict field validation) and kept where it says to preserve them."""
    if isinstance(node, list):
        return [_strict(item) for item in node]
    if not isinstance(node, dict):
        return node
    strict = {key: _strict(value) for key, value in node.items()}
    if (
        "properties" in strict
        and "additionalProperties" not in strict
        and not strict.get("x-kubernetes-preserve-unknown-fields")
    ):
        strict["additionalProperties"] = False
    return strict


def core_problems(resource: dict[str, Any]) -> list[str]:
    import kubernetes_validate

    try:
        kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        return [_where(error)]
    except kubernetes_validate.SchemaNotFoundError as error:
        return [error.message]
    return []


def _where(error: Any) -> str:
    path = "/".join(str(part) for part in error.absolute_path)
    return f"{path or '(root)'}: {error.message}"


# ------------------------------------------------------------------------ serve config


def serve_config_problems(config: dict[str, Any]) -> list[str]:
    from ray.serve.schema import ServeDeploySchema

    try:
        schema = ServeDeploySchema.model_validate(config)
    except Exception as error:  # pydantic's ValidationError
        return [f"ServeDeploySchema: {error}"]
    problems = []
    for app in schema.applications:
        try:
            _deploy_overrides(app)
        except Exception as error:
            problems.append(f"application {app.name!r}: {type(error).__name__}: {error}")
    return problems


def _deploy_overrides(app: Any) -> dict[str, Any]:
    """What Serve's controller does with one application of a config: import the builder,
    call it with the args, build the deployments, apply the `deployments:` overrides (Ray's
    own functions; only the job id, which needs a running Ray, is made up)."""
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.application_state import override_deployment_info
    from ray.serve._private.build_app import build_app
    from ray.serve._private.deploy_utils import deploy_args_to_deployment_info

    application = call_user_app_builder_with_args_if_necessary(
        import_attr(app.import_path), app.args
    )
    built = build_app(application, name=app.name, default_runtime_env={})
    infos = {}
    for deployment in built.deployments:
        ingress = deployment.name == built.ingress_deployment_name
        infos[deployment.name] = deploy_args_to_deployment_info(
            deployment_name=deployment.name,
            deployment_config_proto_bytes=deployment._deployment_config.to_proto_bytes(),
            replica_config_proto_bytes=deployment._replica_config.to_proto_bytes(),
            deployer_job_id="manifest-test",
            app_name=app.name,
            ingress=ingress,
            route_prefix=app.route_prefix if ingress else None,
        )
    return override_deployment_info(infos, app)


# ------------------------------------------------------------------------ RayService


def rayservice_problems(rayservice: dict[str, Any]) -> list[str]:
    spec = rayservice["spec"]
    cluster = spec["rayClusterConfig"]
    serve_config = yaml.safe_load(spec["serveConfigV2"])
    problems = _serve_ports(spec, cluster["headGroupSpec"], serve_config)
    if ((serve_config.get("http_options") or {}).get("ssl_certfile")) and not _probes_overridden(
        cluster
    ):
        problems.append(
            "http_options.ssl_* with KubeRay's own probes: they speak plain HTTP, so no pod "
            "would join the Serve Service (terminate TLS at an Ingress, or override the probes)"
        )
    if not cluster.get("enableInTreeAutoscaling"):
        problems.append("enableInTreeAutoscaling is off: Serve's replicas never get new nodes")
    for app in serve_config["applications"]:
        args = app.get("args") or {}
        problems += [
            f"{name} is in args (a change redeploys every replica): use deployments:"
            for name in AUTOSCALING_IN_ARGS
            if args.get(name)
        ]
        problems += [
            f"{name} is in args (Serve logs args): give it through the pods' environment"
            for name in SECRETS_IN_ARGS
            if args.get(name)
        ]
    drain_s = max(
        float((app.get("args") or {}).get("request_timeout_s", 300))
        for app in serve_config["applications"]
    )
    problems += upgrade_problems(spec, drain_s)
    groups = [("head", cluster["headGroupSpec"])] + [
        (group["groupName"], group) for group in cluster["workerGroupSpecs"]
    ]
    for name, group in groups:
        problems += [f"{name}: {p}" for p in _pod_problems(group["template"]["spec"], drain_s)]
    for group in cluster["workerGroupSpecs"]:
        problems += _model_delivery(group, serve_config)
        problems += [f"{group['groupName']}: {p}" for p in drain_problems(group)]
    return (
        problems + _placement_problems(cluster, serve_config) + _side_channel_tls_problems(cluster)
    )


def _side_channel_tls_problems(cluster: dict[str, Any]) -> list[str]:
    """Where the head names side-channel TLS files (the app's build binds their paths), every
    worker pod must hold them: a Secret volume at that directory, mounted without subPath (so
    renewals reach it), and the same variable."""
    directory = _env_values(_ray(cluster["headGroupSpec"])).get(TLS_DIR_ENV)
    if not directory:
        return []
    problems = []
    for group in cluster["workerGroupSpecs"]:
        pod, ray = group["template"]["spec"], _ray(group)
        env = _env_values(ray)
        secrets = {v["name"] for v in pod.get("volumes", []) if "secret" in v}
        mounted = any(
            m["mountPath"].rstrip("/") == directory.rstrip("/")
            and m["name"] in secrets
            and "subPath" not in m
            for m in ray.get("volumeMounts", [])
        )
        if env.get(TLS_DIR_ENV) != directory or not mounted:
            problems.append(f"{group['groupName']}: no side-channel TLS files at {directory}")
    return problems


def _ray(group: dict[str, Any]) -> dict[str, Any]:
    return group["template"]["spec"]["containers"][0]


def _env_values(container: dict[str, Any]) -> dict[str, str]:
    """A container's plain environment values by name (those from a Secret read as "")."""
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def _placement_problems(cluster: dict[str, Any], config: dict[str, Any]) -> list[str]:
    """Routers on pods without GPUs (by a custom resource only such pods advertise), both
    engine roles under the SLA policy, and a GPU pool bound with a pod of headroom."""
    from deployments.cluster.sla_autoscaling import POLICY_PATH

    problems = []
    overrides = {d["name"]: d for app in config["applications"] for d in app.get("deployments", [])}
    wanted = set(overrides.get("Router", {}).get("ray_actor_options", {}).get("resources", {}))
    offered = {g["groupName"]: _custom_resources(g) for g in cluster["workerGroupSpecs"]}
    gpu_groups = [g["groupName"] for g in cluster["workerGroupSpecs"] if _has_gpu(g)]
    if not wanted or any(wanted & offered[name] for name in gpu_groups):
        problems.append("Router replicas may land on GPU pods (no custom resource keeps them off)")
    elif not any(wanted <= resources for resources in offered.values()):
        problems.append(f"no worker group advertises the Router's resources {sorted(wanted)}")
    engine_max = 0
    for name in ("PrefillServer", "DecodeServer"):
        autoscaling = overrides.get(name, {}).get("autoscaling_config") or {}
        if (autoscaling.get("policy") or {}).get("policy_function") != POLICY_PATH:
            problems.append(f"{name} is not under the SLA autoscaling policy")
        engine_max += int(
            autoscaling.get("max_replicas", overrides.get(name, {}).get("num_replicas", 1))
        )
    for group in cluster["workerGroupSpecs"]:
        if _has_gpu(group) and group.get("maxReplicas", 0) <= engine_max:
            problems.append(
                f"{group['groupName']}: maxReplicas {group.get('maxReplicas')} leaves no headroom "
                f"over the engines' {engine_max}"
            )
    return problems


def _has_gpu(group: dict[str, Any]) -> bool:
    return GPU in _ray(group).get("resources", {}).get("limits", {})


def _custom_resources(group: dict[str, Any]) -> set[str]:
    """The custom resources a group's pods advertise: the group's `resources` (KubeRay >= 1.4,
    read by ray start and the autoscaler alike) or rayStartParams' quoted JSON."""
    raw = group.get("rayStartParams", {}).get("resources", "")
    quoted = set(json.loads(json.loads(raw))) if raw else set()
    return quoted | (set(group.get("resources", {})) - {"CPU", "GPU", "memory", "TPU"})


def _probes_overridden(cluster: dict[str, Any]) -> bool:
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    return all("readinessProbe" in g["template"]["spec"]["containers"][0] for g in groups)


def _serve_ports(spec: dict[str, Any], head: dict[str, Any], config: dict[str, Any]) -> list[str]:
    """KubeRay builds the Serve Service from the head's ports named `serve` or `serve-*`."""
    ports = {
        p["containerPort"]: p.get("name", "")
        for p in head["template"]["spec"]["containers"][0]["ports"]
    }
    problems = []
    wanted = {"HTTP": (config.get("http_options") or {}).get("port", 8000)}
    wanted["gRPC"] = (config.get("grpc_options") or {}).get("port", 9000)
    for api, port in wanted.items():
        name = ports.get(port)
        if name is None or not (name == "serve" or name.startswith("serve-")):
            problems.append(
                f"the head's {api} port {port} is named {name!r}: KubeRay's Serve Service takes "
                "only ports named serve or serve-*"
            )
    service_ports = {
        p["name"]: p for p in spec.get("serveService", {}).get("spec", {}).get("ports", [])
    }
    grpc_name = ports.get(wanted["gRPC"], "")
    if service_ports.get(grpc_name, {}).get("appProtocol") != "kubernetes.io/h2c":
        problems.append(f"serveService port {grpc_name!r} lacks appProtocol kubernetes.io/h2c")
    return problems


def _pod_problems(pod: dict[str, Any], drain_s: float) -> list[str]:
    problems = []
    for container in pod.get("initContainers", []) + pod["containers"]:
        resources = container.get("resources", {})
        if resources.get("requests") != resources.get("limits"):
            problems.append(f"container {container['name']}: requests differ from limits")
    ray = pod["containers"][0]
    from_secret = {
        env["name"] for env in ray.get("env", []) if "secretKeyRef" in env.get("valueFrom", {})
    }
    problems += [
        f"{name} does not come from a Secret" for name in SECRET_ENV if name not in from_secret
    ]
    problems += _key_file_problems(pod, ray) + _grpc_bound_problems(ray)
    if GPU in ray.get("resources", {}).get("limits", {}):
        if not pod.get("nodeSelector"):
            problems.append("GPU pods without a nodeSelector")
        if not any(t.get("key") == GPU for t in pod.get("tolerations", [])):
            problems.append(f"GPU pods without a toleration for {GPU}")
        grace = pod.get("terminationGracePeriodSeconds", 30)
        if grace < drain_s:
            problems.append(
                f"terminationGracePeriodSeconds {grace} < the engines' drain {drain_s:g} s"
            )
    return problems


def _key_file_problems(pod: dict[str, Any], ray: dict[str, Any]) -> list[str]:
    """The API keys: a file in a Secret volume mounted as a directory (a subPath mount never
    sees a rotation), named by PDSERVE_API_KEY_FILE; never in an environment variable."""
    env = {e["name"]: e for e in ray.get("env", [])}
    if "PDSERVE_API_KEY" in env:
        return ["PDSERVE_API_KEY in the environment: a rotation needs new pods (use the file)"]
    path = env.get(KEY_FILE_ENV, {}).get("value", "")
    if not path:
        return [f"no {KEY_FILE_ENV}: the APIs are open"]
    secrets = {v["name"] for v in pod.get("volumes", []) if "secret" in v}
    for mount in ray.get("volumeMounts", []):
        inside = path.startswith(mount["mountPath"].rstrip("/") + "/")
        if inside and mount["name"] in secrets and "subPath" not in mount:
            return []
    return [f"{KEY_FILE_ENV} {path} is not in a Secret volume mounted without subPath"]


def _grpc_bound_problems(ray: dict[str, Any]) -> list[str]:
    env = _env_values(ray)
    value = env.get(GRPC_MESSAGE_ENV, "")
    if not value.isdigit() or not 0 < int(value) <= GRPC_MESSAGE_LIMIT:
        return [f"{GRPC_MESSAGE_ENV} {value or 'unset'}: Serve's proxy reads up to 2 GiB unbounded"]
    return []


def _model_delivery(group: dict[str, Any], config: dict[str, Any]) -> list[str]:
    """Every worker pod must hold the model at the path the app serves, on any node: a
    per-pod volume filled by `pdserve download`, or a ReadOnlyMany claim."""
    from pdserve.cli import _build_parser

    pod = group["template"]["spec"]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for volume in volumes.values():
        claim = volume.get("persistentVolumeClaim")
        if claim is not None and not claim.get("readOnly"):
            return [f"volume {volume['name']}: a shared claim must be mounted readOnly (ROX)"]
    models = {(app.get("args") or {}).get("model", "") for app in config["applications"]}
    fetched = set()
    problems = []
    for init in pod.get("initContainers", []):
        command = init.get("command", [])
        if command[:2] == ["pdserve", "download"]:
            args = _build_parser().parse_args(command[1:])
            fetched.add(str(args.dir))
            if not re.fullmatch(r"[0-9a-f]{40}", args.revision or ""):
                problems.append(
                    f"{init['name']}: --revision {args.revision} is not a commit: pods started "
                    "on different days may load different weights"
                )
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0].get("volumeMounts", [])}
    for model in models:
        mount = next((path for path in mounts if model.startswith(path + "/")), None)
        if mount is None:
            problems.append(f"model {model!r} is on no volume of the {group['groupName']} pods")
        elif model not in fetched and "persistentVolumeClaim" not in volumes[mounts[mount]]:
            problems.append(f"model {model!r}: nothing puts it there (pdserve download)")
    return problems
