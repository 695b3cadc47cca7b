"""Validation helpers for the k8s tests: CRD schema conversion, client-model round trips, kustomize.

`kubectl apply` validates server-side against the same OpenAPI schemas with strict field
validation; here the CRD's schema is turned into a JSON Schema that also rejects unknown fields,
and core objects go through the `kubernetes` client models, which drop unknown fields (so a
lost field is a typo).
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import yaml
from kubernetes.client import ApiClient

REPO = Path(__file__).resolve().parents[2]
KUBERAY_DIR = REPO.parent / "shared" / "kuberay"
RAYSERVICE_CRD = KUBERAY_DIR / "ray.io_rayservices.yaml"
# the Gateway API Inference Extension's InferencePool CRD (v1.0.0, trimmed; kept in the repo)
INFERENCEPOOL_CRD = (
    Path(__file__).parent / "crds" / "inference.networking.k8s.io_inferencepools.yaml"
)


def load_all(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def openapi_to_jsonschema(node: Any) -> Any:
    """Structural OpenAPI v3 (Kubernetes flavour) -> JSON Schema that forbids unknown fields."""
    if isinstance(node, list):
        return [openapi_to_jsonschema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {k: openapi_to_jsonschema(v) for k, v in node.items() if not k.startswith("x-kubernetes")}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.pop("anyOf", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("x-kubernetes-preserve-unknown-fields"):
        return out
    if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


@functools.cache
def _rayservice_schema() -> dict[str, Any]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRD is 1 MB of YAML
    crd = yaml.load(RAYSERVICE_CRD.read_text(), Loader=loader)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = openapi_to_jsonschema(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
    schema["properties"].pop("status", None)
    schema["required"] = ["apiVersion", "kind", "metadata", "spec"]
    return schema


def rayservice_schema() -> dict[str, Any]:
    """JSON Schema of `RayService` `ray.io/v1` from the KubeRay CRD (metadata left to the API)."""
    return copy.deepcopy(_rayservice_schema())


def crd_schema(path: Path, version: str = "v1") -> dict[str, Any]:
    """JSON Schema of a CRD's `version` (strict, as `openapi_to_jsonschema` makes it), status left
    out and apiVersion, kind, metadata and spec required, as the API server asks of an object."""
    crd = yaml.safe_load(path.read_text())
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = openapi_to_jsonschema(copy.deepcopy(served["schema"]["openAPIV3Schema"]))
    schema["properties"].pop("status", None)
    schema["required"] = ["apiVersion", "kind", "metadata", "spec"]
    return schema


def model_roundtrip(obj: dict[str, Any], model: str) -> Any:
    """`obj` through the client model `model` (e.g. V1Service) and back to plain JSON."""
    client = ApiClient()
    typed = client._ApiClient__deserialize(obj, model)  # the client's own JSON decoder
    return client.sanitize_for_serialization(typed)


def lost_fields(original: Any, roundtrip: Any, path: str = "") -> list[str]:
    """Paths present in `original` that the round trip dropped or changed."""
    if isinstance(original, dict):
        if not isinstance(roundtrip, dict):
            return [path or "/"]
        lost = []
        for key, value in original.items():
            if key not in roundtrip:
                lost.append(f"{path}/{key}")
            else:
                lost += lost_fields(value, roundtrip[key], f"{path}/{key}")
        return lost
    if isinstance(original, list):
        if not isinstance(roundtrip, list) or len(original) != len(roundtrip):
            return [path]
        return [p for i, (a, b) in enumerate(zip(original, roundtrip, strict=True))
                for p in lost_fields(a, b, f"{path}/{i}")]  # fmt: skip
    return [] if original == roundtrip else [path]


def json_pointer_remove(doc: Any, pointer: str) -> None:
    """RFC 6902 `remove`: the path must exist."""
    parts = [p.replace("~1", "/").replace("~0", "~") for p in pointer.lstrip("/").split("/")]
    node = doc
    for part in parts[:-1]:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if isinstance(node, list):
        index = int(parts[-1])
        if not 0 <= index < len(node):
            raise KeyError(pointer)
        del node[index]
    else:
        del node[parts[-1]]  # KeyError when absent


def json_pointer_replace(doc: Any, pointer: str, value: Any) -> None:
    """RFC 6902 `replace`: the path must already exist."""
    parts = [p.replace("~1", "/").replace("~0", "~") for p in pointer.lstrip("/").split("/")]
    node = doc
    for part in parts[:-1]:
        node = node[int(part)] if isinstance(node, list) else node[part]
    last = parts[-1]
    if isinstance(node, list):
        index = int(last)
        if not 0 <= index < len(node):
            raise KeyError(pointer)
        node[index] = value
    else:
        if last not in node:
            raise KeyError(pointer)
        node[last] = value


def strategic_merge(base: Any, patch: Any) -> Any:
    """Enough of a strategic merge for our patches: maps merge, everything else replaces."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            merged[key] = strategic_merge(base[key], value) if key in base else value
        return merged
    return patch


def _key(obj: dict[str, Any]) -> tuple[str, str, str]:
    return (obj["apiVersion"], obj["kind"], obj["metadata"]["name"])


def _matches(target: dict[str, Any], obj: dict[str, Any]) -> bool:
    group, _, version = obj["apiVersion"].rpartition("/")
    return (
        target.get("kind", obj["kind"]) == obj["kind"]
        and target.get("name", obj["metadata"]["name"]) == obj["metadata"]["name"]
        and target.get("group", group) == group
        and target.get("version", version) == version
    )


def kustomize_build(directory: Path) -> list[dict[str, Any]]:
    """A small kustomize: resources, namespace, labels, images, JSON6902 and merge patches.

    It fails on what a real build fails on: a missing resource, a patch whose target or path
    does not exist, an image name nothing uses. Used where no kustomize binary is installed.
    """
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    objects: list[dict[str, Any]] = []
    for entry in kust.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            objects += kustomize_build(path)
        elif path.is_file():
            objects += load_all(path)
        else:
            raise FileNotFoundError(f"{directory}: resource {entry} does not exist")
    keys = [_key(o) for o in objects]
    if len(keys) != len(set(keys)):
        raise ValueError(f"{directory}: duplicate objects {keys}")
    for patch in kust.get("patches", []):
        body = load_all(directory / patch["path"])
        if "target" in patch:
            targets = [o for o in objects if _matches(patch["target"], o)]
            if not targets:
                raise ValueError(f"{directory}: patch {patch['path']} matches no object")
            (ops,) = body
            for obj in targets:
                for op in ops:
                    assert op["op"] in ("replace", "remove"), f"unsupported op {op['op']}"
                    if op["op"] == "remove":
                        json_pointer_remove(obj, op["path"])
                    else:
                        json_pointer_replace(obj, op["path"], copy.deepcopy(op["value"]))
        else:
            for doc in body:
                index = next((i for i, o in enumerate(objects) if _key(o) == _key(doc)), None)
                if index is None:
                    raise ValueError(f"{directory}: patch {patch['path']} targets {_key(doc)}")
                objects[index] = strategic_merge(objects[index], doc)
    for label in kust.get("labels", []):
        for obj in objects:
            obj["metadata"].setdefault("labels", {}).update(label["pairs"])
    if namespace := kust.get("namespace"):
        for obj in objects:
            if obj["kind"] != "Namespace":
                obj["metadata"]["namespace"] = namespace
    for image in kust.get("images", []):
        used = False
        for container in containers(objects):
            name, _, _tag = container["image"].partition(":")
            if name == image["name"]:
                container["image"] = f"{image.get('newName', name)}:{image['newTag']}"
                used = True
        if not used:
            raise ValueError(f"{directory}: image {image['name']} is used by no container")
    return objects


def containers(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every container of every pod template in `objects` (RayService head and worker groups)."""
    found = []
    for obj in objects:
        if obj["kind"] != "RayService":
            continue
        cluster = obj["spec"]["rayClusterConfig"]
        groups = [cluster["headGroupSpec"], *cluster.get("workerGroupSpecs", [])]
        for group in groups:
            found += group["template"]["spec"]["containers"]
    return found


def pod_templates(rayservice: dict[str, Any]) -> dict[str, dict[str, Any]]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    templates = {"head": cluster["headGroupSpec"]["template"]}
    for group in cluster.get("workerGroupSpecs", []):
        templates[group["groupName"]] = group["template"]
    return templates


def strict(
    properties: dict[str, Any], required: list[str] | None = None, **extra: Any
) -> dict[str, Any]:
    """A JSON Schema object with these properties and no others."""
    schema = {"type": "object", "additionalProperties": False, "properties": properties, **extra}
    if required:
        schema["required"] = required
    return schema


def operator_object(kind: str, spec: dict[str, Any], metadata: dict[str, Any]) -> dict[str, Any]:
    """A Prometheus Operator object (monitoring.coreos.com/v1) of `kind`, strict."""
    return strict(
        {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": kind},
            "metadata": metadata,
            "spec": spec,
        },
        required=["apiVersion", "kind", "metadata", "spec"],
    )


LABEL_NAME = {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"}
# The Prometheus Operator `PodMonitor` fields we use, strict.
PODMONITOR_SCHEMA = operator_object(
    "PodMonitor",
    strict(
        {
            "selector": strict(
                {"matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}}
            ),
            "podMetricsEndpoints": {
                "type": "array",
                "minItems": 1,
                "items": strict(
                    {
                        "port": {"type": "string"},
                        "path": {"type": "string", "pattern": "^/"},
                        "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                        "relabelings": {
                            "type": "array",
                            "items": strict(
                                {
                                    "sourceLabels": {"type": "array", "items": LABEL_NAME},
                                    "targetLabel": LABEL_NAME,
                                }
                            ),
                        },
                    },
                    required=["port"],
                ),
            },
        },
        required=["selector", "podMetricsEndpoints"],
    ),
    metadata={"type": "object"},
)
