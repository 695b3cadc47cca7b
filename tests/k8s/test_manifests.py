"""The k8s/ manifests: schema-valid, internally consistent, and generated from the GPU config."""

from __future__ import annotations

import json
import shutil
import subprocess
from importlib.metadata import version
from pathlib import Path

import jsonschema
import pytest
import yaml

from deployments.ops import kube, kube_plan, kube_profile
from tests.k8s.k8s_schemas import (
    PODMONITOR_SCHEMA,
    RAYSERVICE_CRD,
    REPO,
    containers,
    kustomize_build,
    load_all,
    lost_fields,
    model_roundtrip,
    pod_templates,
    rayservice_schema,
)

BASE = REPO / "k8s" / "base"
DEV = REPO / "k8s" / "overlays" / "dev"
OVERLAYS = [BASE, DEV]

needs_crd = pytest.mark.skipif(
    not RAYSERVICE_CRD.is_file(),
    reason=f"KubeRay CRD not found at {RAYSERVICE_CRD} (shared/ beside the checkout)",
)


def _by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


@pytest.fixture(scope="module", params=OVERLAYS, ids=lambda p: p.name)
def built(request: pytest.FixtureRequest) -> list[dict]:
    return kustomize_build(request.param)


@pytest.fixture(scope="module")
def base_rayservice() -> dict:
    (obj,) = load_all(BASE / "rayservice.yaml")
    return obj


def test_generated_files_are_fresh() -> None:
    assert kube.stale(REPO) == [], "run `molora k8s render` and commit the result"


def test_ray_version_matches_the_serve_extra() -> None:
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'"ray[serve]=={kube.RAY_VERSION}"' in pyproject
    assert version("ray") == kube.RAY_VERSION


@needs_crd
def test_rayservice_validates_against_kuberay_crd(built: list[dict]) -> None:
    schema = rayservice_schema()
    (rayservice,) = _by_kind(built, "RayService")
    jsonschema.validate(rayservice, schema)


@needs_crd
def test_crd_schema_rejects_a_typo(base_rayservice: dict) -> None:
    """The converted schema is strict: an unknown field is an error, like kubectl's."""
    broken = yaml.safe_load(yaml.safe_dump(base_rayservice))
    broken["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplica"] = 3
    with pytest.raises(jsonschema.ValidationError, match="maxReplica"):
        jsonschema.validate(broken, rayservice_schema())


def test_pod_templates_and_service_are_valid_core_objects(built: list[dict]) -> None:
    (rayservice,) = _by_kind(built, "RayService")
    for name, template in pod_templates(rayservice).items():
        lost = lost_fields(template, model_roundtrip(template, "V1PodTemplateSpec"))
        assert lost == [], f"{name}: fields unknown to V1PodTemplateSpec: {lost}"
    service = rayservice["spec"]["serveService"]
    assert lost_fields(service, model_roundtrip(service, "V1Service")) == []


@pytest.mark.parametrize(
    ("kind", "model"),
    [
        ("ConfigMap", "V1ConfigMap"),
        ("Namespace", "V1Namespace"),
        ("PodDisruptionBudget", "V1PodDisruptionBudget"),
    ],
)
def test_core_objects_roundtrip(built: list[dict], kind: str, model: str) -> None:
    for obj in _by_kind(built, kind):
        assert lost_fields(obj, model_roundtrip(obj, model)) == [], obj["metadata"]["name"]


def test_podmonitor_schema_and_selector(built: list[dict]) -> None:
    (monitor,) = _by_kind(built, "PodMonitor")
    jsonschema.validate(monitor, PODMONITOR_SCHEMA)
    (rayservice,) = _by_kind(built, "RayService")
    selector = monitor["spec"]["selector"]["matchLabels"]
    ports = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    for name, template in pod_templates(rayservice).items():
        labels = template["metadata"]["labels"]
        assert selector.items() <= labels.items(), f"PodMonitor misses the {name} pods"
        (container,) = template["spec"]["containers"]
        named = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports <= named.keys()
        assert named["metrics"] == kube_profile.METRICS_PORT


def test_rayservice_shape(built: list[dict]) -> None:
    (rayservice,) = _by_kind(built, "RayService")
    (configmap,) = _by_kind(built, "ConfigMap")
    cluster = rayservice["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    # One worker group per GPU type, each on its nodes (node label) with a Ray resource naming it.
    for worker in cluster["workerGroupSpecs"]:
        assert worker["minReplicas"] <= worker["replicas"] <= worker["maxReplicas"]
        (gpu,) = worker["template"]["spec"]["containers"]
        assert gpu["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert gpu["resources"]["requests"]["nvidia.com/gpu"] == "1"
        probe = gpu["readinessProbe"]["httpGet"]
        assert (probe["path"], probe["port"]) == ("/-/healthz", kube_profile.SERVE_PORT)
        gpu_type = worker["groupName"].removeprefix("gpu-")
        resources = json.loads(worker["rayStartParams"]["resources"].strip("'"))
        assert resources == {f"gpu_{gpu_type}": 1}
        assert worker["template"]["spec"]["nodeSelector"]["nvidia.com/gpu.product"]
    (secret,) = load_all(BASE / "s3-credentials.example.yaml")
    for container in containers([rayservice]):
        assert set(container["resources"]) == {"requests", "limits"}
        refs = {next(iter(ref)): ref[next(iter(ref))]["name"] for ref in container["envFrom"]}
        assert refs == {
            "configMapRef": configmap["metadata"]["name"],
            "secretRef": secret["metadata"]["name"],
        }
    assert "AWS_ENDPOINT_URL" in configmap["data"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    ports = rayservice["spec"]["serveService"]["spec"]["ports"]
    assert [(p["port"], p["targetPort"]) for p in ports] == [(kube_profile.SERVE_PORT, "serve")]
    # The Service's named port is each worker's router and the head's proxy; every pod's Serve
    # controller and routers read the router's fixed port from the pod's environment.
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    workers = [w["template"]["spec"]["containers"][0] for w in cluster["workerGroupSpecs"]]
    named = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert named["serve"] == kube_profile.PROXY_PORT_HEAD
    for container in [head, *workers]:
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
        assert env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] == str(kube_profile.SERVE_PORT)
    for worker in workers:
        assert {p["name"]: p["containerPort"] for p in worker["ports"]}["serve"] == (
            kube_profile.SERVE_PORT
        )


def test_secret_example_holds_placeholders_only() -> None:
    (secret,) = load_all(BASE / "s3-credentials.example.yaml")
    assert lost_fields(secret, model_roundtrip(secret, "V1Secret")) == []
    assert set(secret["stringData"].values()) == {"REPLACE_ME"}
    kust = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    assert "s3-credentials.example.yaml" not in kust["resources"]


def test_serve_autoscaling_fits_the_worker_group(built: list[dict]) -> None:
    (rayservice,) = _by_kind(built, "RayService")
    serve = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    worker = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]  # the sized group
    gpus_per_node = int(
        worker["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    )
    gpu_deployments = [
        d
        for app in serve["applications"]
        for d in app.get("deployments", [])
        if (d.get("ray_actor_options") or {}).get("num_gpus", 0) > 0
    ]
    assert gpu_deployments, "the GPU config runs no GPU deployment"
    for deployment in gpu_deployments:
        scaling = deployment["autoscaling_config"]
        per_replica = deployment["ray_actor_options"]["num_gpus"]
        capacity = worker["maxReplicas"] * gpus_per_node / per_replica
        assert 1 <= scaling["min_replicas"] <= scaling["max_replicas"] <= capacity
    # Every deployment's minimum fits on the CPUs of the workers (the head runs no replicas).
    cpus_needed = sum(
        d["autoscaling_config"]["min_replicas"] * (d.get("ray_actor_options") or {})["num_cpus"]
        for app in serve["applications"]
        for d in app["deployments"]
    )
    worker_cpus = int(worker["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"])
    assert cpus_needed <= max(1, worker["maxReplicas"]) * worker_cpus
    assert serve["http_options"]["host"] == "0.0.0.0"
    # Direct ingress: the routers serve SERVE_PORT; Serve's proxy, on the head only, the next.
    assert serve["http_options"]["port"] == kube_profile.PROXY_PORT_HEAD
    assert serve["proxy_location"] == "HeadOnly"


def test_embedded_serve_config_validates(built: list[dict]) -> None:
    """serveConfigV2 is a valid Ray Serve deploy config whose args are a valid `ServeConfig`."""
    from ray.serve.schema import ServeDeploySchema

    from deployments.config import ServeConfig

    (rayservice,) = _by_kind(built, "RayService")
    serve = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve)
    for app in serve["applications"]:
        ServeConfig.from_args(app.get("args"))


def test_embedded_serve_config_is_the_gpu_config() -> None:
    """Same application as serve_config.gpu.yaml: only host/port and autoscaling may differ."""
    gpu = kube_plan.load_serve_config(REPO / kube.GPU_SERVE_CONFIG)
    (rayservice,) = load_all(BASE / "rayservice.yaml")
    cluster = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    assert len(cluster["applications"]) == len(gpu["applications"])
    for mine, theirs in zip(cluster["applications"], gpu["applications"], strict=True):
        for key in ("name", "import_path", "route_prefix", "args", "runtime_env"):
            assert mine.get(key) == theirs.get(key), key
        names = [d["name"] for d in theirs.get("deployments", [])]
        assert [d["name"] for d in mine.get("deployments", [])] == names


def test_overlay_patches_only_existing_paths(tmp_path: Path) -> None:
    """A JSON6902 `replace` on a path the base lacks fails the build instead of adding it."""
    (tmp_path / "base").mkdir()
    (tmp_path / "overlay").mkdir()
    shutil.copy(BASE / "rayservice.yaml", tmp_path / "base" / "rayservice.yaml")
    (tmp_path / "base" / "kustomization.yaml").write_text("resources: [rayservice.yaml]\n")
    ops = [{"op": "replace", "path": "/spec/rayClusterConfig/nope", "value": 1}]
    (tmp_path / "overlay" / "p.yaml").write_text(yaml.safe_dump(ops))
    (tmp_path / "overlay" / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "resources": ["../base"],
                "patches": [{"path": "p.yaml", "target": {"kind": "RayService"}}],
            }
        )
    )
    with pytest.raises(KeyError):
        kustomize_build(tmp_path / "overlay")


def _kustomize_binary() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


@pytest.mark.skipif(_kustomize_binary() is None, reason="no kustomize/kubectl binary installed")
@pytest.mark.parametrize("directory", OVERLAYS, ids=lambda p: p.name)
def test_real_kustomize_agrees(directory: Path) -> None:
    """Where a real kustomize exists, its build equals ours (so ours is not wishful)."""
    command = _kustomize_binary()
    assert command is not None
    try:
        out = subprocess.run(
            [*command, str(directory)], capture_output=True, text=True, timeout=60, check=True
        ).stdout
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        pytest.fail(f"{command} failed: {getattr(exc, 'stderr', exc)}")
    real = sorted((o for o in yaml.safe_load_all(out) if o), key=lambda o: o["kind"])
    ours = sorted(kustomize_build(directory), key=lambda o: o["kind"])
    assert real == ours


@needs_crd
def test_crd_knows_token_auth_with_a_user_secret() -> None:
    """The KubeRay version we validate against has `authOptions` with a user-named Secret."""
    schema = rayservice_schema()
    auth = schema["properties"]["spec"]["properties"]["rayClusterConfig"]["properties"][
        "authOptions"
    ]
    assert "token" in auth["properties"]["mode"]["enum"]
    assert auth["properties"]["secretName"]["type"] == "string"
    broken = {"mode": "tokn"}
    with pytest.raises(jsonschema.ValidationError, match="tokn"):
        jsonschema.validate(broken, auth)


def test_ray_token_auth_and_api_keys_from_secrets(built: list[dict]) -> None:
    (rayservice,) = _by_kind(built, "RayService")
    cluster = rayservice["spec"]["rayClusterConfig"]
    (token_secret,) = load_all(BASE / "ray-auth-token.example.yaml")
    (keys_secret,) = load_all(BASE / "api-keys.example.yaml")
    assert cluster["authOptions"] == {
        "mode": "token",
        "secretName": token_secret["metadata"]["name"],
    }
    assert set(token_secret["stringData"]) == {"auth_token"}  # KubeRay's key name
    # Every Ray pod mounts the API key Secret where the Serve config's auth reads it.
    serve = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    (app,) = serve["applications"]
    auth = app["args"]["server"]["auth"]
    assert auth["enabled"] is True
    keys_path = Path(auth["keys_file"])
    assert keys_path.name in keys_secret["stringData"]
    for name, template in pod_templates(rayservice).items():
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        (container,) = template["spec"]["containers"]
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        (volume,) = [v for v in volumes.values() if "secret" in v]
        assert volume["secret"]["secretName"] == keys_secret["metadata"]["name"], name
        mount = mounts[volume["name"]]
        assert mount["readOnly"] is True and Path(mount["mountPath"]) == keys_path.parent, name
        # No secret value is inlined in the pod spec.
        assert "RAY_AUTH_TOKEN" not in yaml.safe_dump(container)


@pytest.mark.parametrize(
    "example",
    ["ray-auth-token.example.yaml", "api-keys.example.yaml", "redis-password.example.yaml"],
)
def test_auth_secret_examples_hold_placeholders_only(example: str) -> None:
    (secret,) = load_all(BASE / example)
    assert lost_fields(secret, model_roundtrip(secret, "V1Secret")) == []
    assert set(secret["stringData"].values()) == {"REPLACE_ME"}
    kust = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    assert example not in kust["resources"]


def test_disruption_budget_upgrade_strategy_and_gcs_fault_tolerance(built: list[dict]) -> None:
    """Drains take one GPU worker at a time, cluster changes bring up a new cluster before the
    old one goes, and the head's state lives in an external Redis (password from a Secret)."""
    (rayservice,) = _by_kind(built, "RayService")
    (pdb,) = _by_kind(built, "PodDisruptionBudget")
    workers = pod_templates(rayservice)
    selector = pdb["spec"]["selector"]["matchLabels"]
    for name, template in workers.items():
        labels = template["metadata"]["labels"]
        covered = all(labels.get(k) == v for k, v in selector.items())
        assert covered == (name != "head"), name
    assert pdb["spec"]["maxUnavailable"] == 1
    assert rayservice["spec"]["upgradeStrategy"] == {"type": "NewCluster"}
    ft = rayservice["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    (secret,) = load_all(BASE / "redis-password.example.yaml")
    ref = ft["redisPassword"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": secret["metadata"]["name"], "key": "password"}
    assert set(secret["stringData"]) == {"password"}
    assert ft["redisAddress"].startswith("redis://")


def test_api_scrape_targets_the_openai_service(built: list[dict]) -> None:
    """The API port's /metrics is scraped once, through the Service the RayService creates."""
    (scrape,) = _by_kind(built, "ScrapeConfig")
    (rayservice,) = _by_kind(built, "RayService")
    service = rayservice["spec"]["serveService"]
    (sd,) = scrape["spec"]["kubernetesSDConfigs"]
    assert sd["role"] == "Service" and sd["namespaces"] == {"ownNamespace": True}
    (keep,) = scrape["spec"]["relabelings"]
    label, port = keep["regex"].split(";")
    assert keep["action"] == "keep"
    assert service["metadata"]["labels"]["app.kubernetes.io/name"] == label
    assert port in {p["name"] for p in service["spec"]["ports"]}
    assert scrape["spec"]["metricsPath"] == "/metrics"
