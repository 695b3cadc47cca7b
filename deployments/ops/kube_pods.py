"""The head and worker pod groups of the RayService: containers, volumes, probes, node selection."""

from __future__ import annotations

import json
from typing import Any

from deployments.api.proxy_guard import CAP_ENV
from deployments.ops.kube_groups import GpuGroup, PodResources
from deployments.ops.kube_plan import Plan
from deployments.ops.kube_profile import (
    API_KEYS_DIR,
    APP_LABEL,
    METRICS_PORT,
    PROXY_PORT_HEAD,
    SERVE_PORT,
    ClusterProfile,
)
from deployments.replica.serve_env import CLUSTER_DRAINING_S, PROXY_ENV_VARS, direct_ingress_env

# A draining router answers /-/healthz 503 for CLUSTER_DRAINING_S: the probe must fail the pod
# out of the Service's endpoints well within that (here after 3 x 2 s).
READINESS_PERIOD_S = 2
READINESS_FAILURES = 3


def _env_from(profile: ClusterProfile) -> list[dict[str, Any]]:
    # The ConfigMap holds AWS_ENDPOINT_URL (boto3 reads it when the store sets no endpoint_url);
    # the Secret holds AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, created by the user.
    return [
        {"configMapRef": {"name": profile.store_config_map}},
        {"secretRef": {"name": profile.s3_secret}},
    ]


def _volumes(profile: ClusterProfile) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    # Ray's object store lives in /dev/shm; the container default (64 MiB) is far too small.
    # The API key file (salted hashes only) is a mounted Secret, so rotating keys is a
    # `kubectl apply` of the Secret: the kubelet updates the file and the ingress re-reads it.
    return (
        [
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
            {
                "name": "api-keys",
                "secret": {"secretName": profile.api_keys_secret},
            },
        ],
        [
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "api-keys", "mountPath": API_KEYS_DIR, "readOnly": True},
        ],
    )


def _container(
    name: str, profile: ClusterProfile, resources: PodResources, ports: list[dict[str, Any]]
) -> dict[str, Any]:
    volumes_mounts = _volumes(profile)[1]
    return {
        "name": name,
        "image": profile.image,
        "imagePullPolicy": "IfNotPresent",
        "ports": ports,
        "envFrom": _env_from(profile),
        # Ray starts its workers (the engines) at nice 15 unless told otherwise, below its own
        # raylet and agents in the same pod: serving runs at nice 0. The proxy and the routers'
        # own HTTP servers read the stream guard's import path from the pod's environment, and
        # Serve's controller the router's fixed port and draining period.
        "env": [
            {"name": "RAY_worker_niceness", "value": "0"},
            *({"name": k, "value": v} for k, v in PROXY_ENV_VARS.items()),
            *(
                {"name": k, "value": v}
                for k, v in direct_ingress_env(SERVE_PORT, CLUSTER_DRAINING_S).items()
            ),
            # auth is on in the cluster: the proxy refuses a key's flood at the router's cap
            {"name": CAP_ENV, "value": "64"},
        ],
        "resources": resources.to_k8s(),
        "volumeMounts": volumes_mounts,
        "lifecycle": {"preStop": {"exec": {"command": ["/bin/sh", "-c", "ray stop"]}}},
    }


def pod_labels(component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": APP_LABEL, "app.kubernetes.io/component": component}


def head_group(profile: ClusterProfile) -> dict[str, Any]:
    ports = [
        {"name": "gcs-server", "containerPort": 6379},
        {"name": "dashboard", "containerPort": 8265},
        {"name": "client", "containerPort": 10001},
        # no router here (num-cpus 0): the head's door to the API is Serve's proxy
        {"name": "serve", "containerPort": PROXY_PORT_HEAD},
        {"name": "metrics", "containerPort": METRICS_PORT},
    ]
    return {
        # num-cpus 0 keeps Serve replicas off the head; its proxy and controller still run there.
        "rayStartParams": {
            "num-cpus": "0",
            "dashboard-host": "0.0.0.0",
            "metrics-export-port": str(METRICS_PORT),
        },
        "template": {
            "metadata": {"labels": pod_labels("ray-head")},
            "spec": {
                "containers": [_container("ray-head", profile, profile.head, ports)],
                "volumes": _volumes(profile)[0],
            },
        },
    }


def worker_groups(profile: ClusterProfile, sized: Plan) -> list[dict[str, Any]]:
    """The sized group first (the dev overlay patches it), then one per extra GPU type."""
    primary = GpuGroup(
        gpu_type=profile.gpu_type, product=profile.gpu_product, worker=profile.worker
    )
    groups = [_worker_group(profile, primary, sized.min_workers, sized.max_workers)]
    for extra in profile.extra_gpu_groups:
        groups.append(_worker_group(profile, extra, 0, extra.max_workers))
    return groups


def _worker_group(
    profile: ClusterProfile, group: GpuGroup, min_workers: int, max_workers: int
) -> dict[str, Any]:
    ports = [
        {"name": "serve", "containerPort": SERVE_PORT},
        {"name": "metrics", "containerPort": METRICS_PORT},
    ]
    container = _container("ray-worker", profile, group.worker, ports)
    # Ready only while this node's router serves (not yet started, draining or absent: not
    # ready): the OpenAI Service routes to ready pods only.
    container["readinessProbe"] = {
        "httpGet": {"path": "/-/healthz", "port": SERVE_PORT},
        "initialDelaySeconds": 10,
        "periodSeconds": READINESS_PERIOD_S,
        "timeoutSeconds": 2,
        "failureThreshold": READINESS_FAILURES,
    }
    # Ray's `resources` start parameter is a JSON object quoted for the shell.
    resources = json.dumps({f"gpu_{group.gpu_type}": group.worker.gpus})
    return {
        "groupName": f"gpu-{group.gpu_type}",
        "replicas": min_workers,
        "minReplicas": min_workers,
        "maxReplicas": max_workers,
        "idleTimeoutSeconds": profile.worker_idle_timeout_s,
        "rayStartParams": {"metrics-export-port": str(METRICS_PORT), "resources": f"'{resources}'"},
        "template": {
            "metadata": {"labels": pod_labels("ray-worker")},
            "spec": {
                "containers": [container],
                "volumes": _volumes(profile)[0],
                "nodeSelector": {"nvidia.com/gpu.product": group.product},
                "tolerations": [
                    {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
                ],
            },
        },
    }
