"""The overlays under k8s/overlays, rendered by the real kustomize: each is a valid RayService,
every patch of each changes what it renders, and each does what it is for; and an overlay as an
SRE writes one (namespace, images, labels, stacked on another) renders as kustomize intends."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.manifest_checks import (
    K8S,
    KUBERAY_SCHEMA,
    core_problems,
    crd_problems,
    documents,
    kustomize,
    rayservice_problems,
)
from tests.unit.test_manifests import (
    OVERLAYS,
    gpu_pod,
    overlaid,
    the_rayservice,
)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_overlay_changes_the_base_into_valid_objects(overlay: str) -> None:
    rendered = kustomize(K8S / "overlays" / overlay)
    assert rendered != kustomize(K8S / "base")
    for resource in rendered:
        if resource["kind"] != "RayService":
            assert core_problems(resource) == [], resource["metadata"]["name"]
    patched = the_rayservice(rendered)
    assert crd_problems(patched, KUBERAY_SCHEMA) == []
    assert rayservice_problems(patched) == []


def test_an_overlay_under_its_base_is_a_cycle(tmp_path: Path) -> None:
    """The layout kustomize refuses (a base directory holding its overlays), as it refuses it."""
    (tmp_path / "rayservice.yaml").write_text((K8S / "base" / "rayservice.yaml").read_text())
    (tmp_path / "kustomization.yaml").write_text("resources: [rayservice.yaml]\n")
    overlay = tmp_path / "overlays" / "rdma"
    overlay.mkdir(parents=True)
    for name in ("kustomization.yaml", "rdma.patch.yaml"):
        text = (K8S / "overlays" / "rdma" / name).read_text()
        (overlay / name).write_text(text.replace("../../base", "../.."))
    with pytest.raises(ValueError, match="cycle"):
        kustomize(overlay)


def pod_templates(resource: dict[str, Any]) -> list[dict[str, Any]]:
    cluster = resource["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"]] + [
        group["template"] for group in cluster["workerGroupSpecs"]
    ]


def test_a_site_overlay_sets_namespace_images_and_labels_as_kustomize_does(tmp_path: Path) -> None:
    """What an SRE writes (namespace, images, labels, a stacked overlay), rendered by the real
    kustomize: every container runs the site's image, every object is in the namespace, and
    the RayService and each pod template carry the labels, selectors left alone."""
    site = tmp_path / "k8s" / "overlays" / "mine"
    site.mkdir(parents=True)
    for part in ("base", "overlays/rdma"):
        shutil.copytree(K8S / part, tmp_path / "k8s" / part)
    (site / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "resources": ["../rdma"],
                "namespace": "llm-serving",
                "images": [
                    {
                        "name": "registry.example.com/pdserve",
                        "newName": "registry.mysite.example/ml/pdserve",
                        "newTag": "2.0.1",
                    }
                ],
                "labels": [{"pairs": {"team": "inference"}, "includeTemplates": True}],
            }
        )
    )
    rendered = kustomize(site)
    resource = the_rayservice(rendered)
    assert {r["metadata"]["namespace"] for r in rendered} == {"llm-serving"}
    assert resource["metadata"]["namespace"] == "llm-serving"
    assert resource["metadata"]["labels"]["team"] == "inference"
    images = [
        container["image"]
        for template in pod_templates(resource)
        for container in template["spec"].get("initContainers", []) + template["spec"]["containers"]
    ]
    assert len(images) >= 3 and set(images) == {"registry.mysite.example/ml/pdserve:2.0.1"}
    assert all(t["metadata"]["labels"]["team"] == "inference" for t in pod_templates(resource))
    assert "rdma/" in str(gpu_pod(resource)["containers"][0]["resources"])  # the stacked overlay
    assert crd_problems(resource, KUBERAY_SCHEMA) == []
    assert rayservice_problems(resource) == []


def test_the_shipped_site_overlay_is_the_base_with_site_values() -> None:
    base = documents(K8S / "base" / "rayservice.yaml")[0]
    site = the_rayservice(kustomize(K8S / "overlays" / "site"))
    assert site["metadata"]["namespace"] and site["metadata"]["labels"]
    assert all(t["metadata"]["labels"] for t in pod_templates(site))
    assert site["spec"]["serveConfigV2"] == base["spec"]["serveConfigV2"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_patch_of_an_overlay_changes_what_it_renders(tmp_path: Path, overlay: str) -> None:
    """kustomize applies a patch whose target matches nothing as a no-op, silently (a typo in
    a target's name): each shipped patch must change the output when it is there."""
    full = kustomize(K8S / "overlays" / overlay)
    config = yaml.safe_load((K8S / "overlays" / overlay / "kustomization.yaml").read_text())
    for index in range(len(config.get("patches", []))):
        copy_root = tmp_path / str(index)
        shutil.copytree(K8S, copy_root)
        less = copy.deepcopy(config)
        del less["patches"][index]
        (copy_root / "overlays" / overlay / "kustomization.yaml").write_text(yaml.safe_dump(less))
        assert kustomize(copy_root / "overlays" / overlay) != full, config["patches"][index]


def test_the_rdma_overlay_gives_ucx_the_nic_and_locked_memory() -> None:
    worker = gpu_pod(overlaid("rdma"))["containers"][0]
    env = {e["name"]: e.get("value") for e in worker["env"]}
    assert env["UCX_TLS"].split(",")[0] == "rc"
    assert env["UCX_NET_DEVICES"]
    assert "IPC_LOCK" in worker["securityContext"]["capabilities"]["add"]
    rdma = [name for name in worker["resources"]["limits"] if name.startswith("rdma/")]
    assert rdma and all(worker["resources"]["requests"][name] == "1" for name in rdma)


def test_the_model_volume_overlay_mounts_one_read_only_claim_and_fetches_nothing() -> None:
    patched = overlaid("model-volume")
    for group in patched["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        assert "initContainers" not in pod
        (models,) = [v for v in pod["volumes"] if v["name"] == "models"]
        assert models["persistentVolumeClaim"] == {"claimName": "pdserve-models", "readOnly": True}
        mount = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "models"]
        assert mount == [{"name": "models", "mountPath": "/models", "readOnly": True}]


def test_the_gcs_ft_overlay_points_ray_at_redis() -> None:
    patched = overlaid("gcs-ft")
    options = patched["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    assert options["redisAddress"]
    assert "secretKeyRef" in options["redisPassword"]["valueFrom"]


def test_the_network_policy_confines_the_ray_pods_to_the_app_but_for_its_front_door() -> None:
    rendered = kustomize(K8S / "overlays" / "network-policy")
    (policy,) = [r for r in rendered if r["kind"] == "NetworkPolicy"]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    for template in pod_templates(the_rayservice(rendered)):
        assert selector.items() <= template["metadata"]["labels"].items()
    rules = policy["spec"]["ingress"]
    open_ports = {p["port"] for r in rules if "from" not in r for p in r["ports"]}
    assert open_ports == {8000, 9000}  # the Serve proxies, and nothing else, from anywhere
    (own,) = [r for r in rules if "ports" not in r]  # every port, from the app's pods only
    assert own["from"] == [{"podSelector": {"matchLabels": selector}}]
    reachable_from_elsewhere = {p["port"] for r in rules if "ports" in r for p in r["ports"]}
    assert not reachable_from_elsewhere & {6379, 10001}  # the GCS, the Ray client


def test_the_side_channel_tls_overlay_gives_every_worker_the_certificate() -> None:
    """The head names cert-manager's Secret directory; every worker pod mounts it (without
    subPath, so renewals arrive) under the same variable; a group left out is refused."""
    patched = overlaid("side-channel-tls")
    assert rayservice_problems(patched) == []
    for group in patched["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        volumes = {v["name"]: v for v in group["template"]["spec"]["volumes"]}
        assert volumes["engine-tls"]["secret"] == {"secretName": "pdserve-engine-tls"}
    broken = copy.deepcopy(patched)
    routers = broken["spec"]["rayClusterConfig"]["workerGroupSpecs"][1]["template"]["spec"]
    mounts = routers["containers"][0]["volumeMounts"]
    mounts[:] = [m for m in mounts if m["name"] != "engine-tls"]
    assert rayservice_problems(broken) == [
        "cpu: no side-channel TLS files at /etc/pdserve/engine-tls"
    ]


def test_the_ingress_overlay_fronts_both_apis_with_tls() -> None:
    rendered = kustomize(K8S / "overlays" / "ingress")
    service = the_rayservice(rendered)["spec"]["serveService"]
    ports = {p["port"] for p in service["spec"]["ports"]}
    ingresses = {r["metadata"]["name"]: r for r in rendered if r["kind"] == "Ingress"}
    assert set(ingresses) == {"pdserve-http", "pdserve-grpc"}
    for name, port in (("pdserve-http", 8000), ("pdserve-grpc", 9000)):
        spec = ingresses[name]["spec"]
        hosts = {rule["host"] for rule in spec["rules"]}
        assert hosts <= {h for tls in spec["tls"] for h in tls["hosts"]}  # every host on TLS
        (path,) = [p for rule in spec["rules"] for p in rule["http"]["paths"]]
        backend = path["backend"]["service"]
        assert backend == {"name": service["metadata"]["name"], "port": {"number": port}}
        assert port in ports
        annotations = ingresses[name]["metadata"]["annotations"]
        assert int(annotations["nginx.ingress.kubernetes.io/proxy-read-timeout"]) > 300
    grpc_annotations = ingresses["pdserve-grpc"]["metadata"]["annotations"]
    assert grpc_annotations["nginx.ingress.kubernetes.io/backend-protocol"] == "GRPC"


INCREMENTAL_BREAKS: dict[str, tuple[dict[str, Any], str]] = {
    "no gateway class": ({"gatewayClassName": ""}, "without a gatewayClassName"),
    "traffic outruns capacity": ({"stepSizePercent": 75}, "need 0 < stepSizePercent (75)"),
    "no pause between steps": ({"intervalSeconds": 5}, "intervalSeconds under 30"),
}


def test_the_incremental_upgrade_overlay_surges_a_share_of_the_gpu_pods() -> None:
    """KubeRay's incremental upgrade, set as KubeRay 1.7's schema takes it: a GPU pod's share
    of the base's minimum per capacity step (Serve starts one replica per role at the first
    step whatever the share), traffic in smaller steps a minute apart; and each way of setting
    it that KubeRay could not carry out is caught."""
    rayservice = the_rayservice(kustomize(K8S / "overlays" / "incremental-upgrade"))
    strategy = rayservice["spec"]["upgradeStrategy"]
    assert strategy["type"] == "NewClusterWithIncrementalUpgrade"
    options = strategy["clusterUpgradeOptions"]
    (gpu,) = [
        g
        for g in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
        if g["groupName"] == "gpu"
    ]
    assert options["maxSurgePercent"] == 100 // gpu["minReplicas"]
    for name, (change, expected) in INCREMENTAL_BREAKS.items():
        broken = copy.deepcopy(rayservice)
        broken["spec"]["upgradeStrategy"]["clusterUpgradeOptions"].update(change)
        assert any(expected in p for p in rayservice_problems(broken)), name
    no_autoscaler = copy.deepcopy(rayservice)
    no_autoscaler["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] = False
    assert any("capacity never moves" in p for p in rayservice_problems(no_autoscaler))
    unknown = copy.deepcopy(rayservice)
    unknown["spec"]["upgradeStrategy"]["type"] = "Rolling"
    assert any("upgradeStrategy.type 'Rolling'" in p for p in rayservice_problems(unknown))
