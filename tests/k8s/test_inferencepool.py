"""k8s/base/inferencepool.yaml: valid against the InferencePool CRD (Gateway API Inference
Extension v1), its CEL rules and later releases' bounds, and pointed at the RayService's routers."""

from __future__ import annotations

import copy

import jsonschema
import pytest
import yaml

from deployments.ops import kube_profile
from tests.k8s.k8s_schemas import (
    INFERENCEPOOL_CRD,
    REPO,
    crd_schema,
    kustomize_build,
    load_all,
    pod_templates,
)

BASE = REPO / "k8s" / "base"
POOL = BASE / "inferencepool.yaml"


@pytest.fixture(scope="module")
def pool() -> dict:
    (obj,) = load_all(POOL)
    return obj


@pytest.fixture(scope="module")
def schema() -> dict:
    return crd_schema(INFERENCEPOOL_CRD)


def test_pool_validates_against_the_crd(pool: dict, schema: dict) -> None:
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["kind"] == "InferencePool"
    jsonschema.validate(pool, schema)


def test_crd_schema_is_strict(pool: dict, schema: dict) -> None:
    """An unknown field (a typo, or v1alpha2's `targetPortNumber`) fails, like kubectl's."""
    broken = copy.deepcopy(pool)
    broken["spec"]["targetPortNumber"] = 8000
    with pytest.raises(jsonschema.ValidationError, match="targetPortNumber"):
        jsonschema.validate(broken, schema)
    broken = copy.deepcopy(pool)
    del broken["spec"]["endpointPickerRef"]["port"]["number"]
    with pytest.raises(jsonschema.ValidationError, match="number"):
        jsonschema.validate(broken, schema)


def test_cel_rules_and_later_releases_bounds(pool: dict) -> None:
    """What the JSON Schema cannot say: the CRD's CEL rules (a Service picker needs a port; target
    ports are unique) and v1.5's 1 to 64 matchLabels."""
    picker = pool["spec"]["endpointPickerRef"]
    assert picker.get("kind", "Service") != "Service" or "port" in picker
    numbers = [p["number"] for p in pool["spec"]["targetPorts"]]
    assert len(numbers) == len(set(numbers)) == 1
    assert 1 <= len(pool["spec"]["selector"]["matchLabels"]) <= 64
    assert "appProtocol" not in pool["spec"]  # v1.0.0 does not know it


def test_pool_selects_every_router_and_only_routers(pool: dict) -> None:
    """The selector matches each GPU worker group's pods (a router serves the API there on
    SERVE_PORT) and not the head (only Serve's proxy, on another port)."""
    (rayservice,) = [o for o in kustomize_build(BASE) if o["kind"] == "RayService"]
    selector = pool["spec"]["selector"]["matchLabels"]
    (target,) = [p["number"] for p in pool["spec"]["targetPorts"]]
    assert target == kube_profile.SERVE_PORT
    for name, template in pod_templates(rayservice).items():
        labels = template["metadata"]["labels"]
        selected = selector.items() <= labels.items()
        assert selected == (name != "head"), name
        (container,) = template["spec"]["containers"]
        ports = {p["containerPort"] for p in container["ports"]}
        assert (target in ports) == selected, name


def test_pool_is_opt_in() -> None:
    """Not in the base's resources: `kubectl apply -k` must work on clusters without the CRD."""
    kust = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    assert POOL.name not in kust["resources"]
