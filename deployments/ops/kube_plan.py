"""Adapt the GPU Serve config to a cluster and size the GPU worker group to hold it."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from deployments.ops.kube_profile import PROXY_PORT_HEAD, ClusterProfile


def load_serve_config(path: Path) -> dict[str, Any]:
    """A Ray Serve config file (`applications: [...]`) as a dict."""
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("applications"), list):
        raise ValueError(f"{path}: not a Ray Serve config file (no `applications` list)")
    return data


def _gpus(deployment: dict[str, Any]) -> float:
    return float((deployment.get("ray_actor_options") or {}).get("num_gpus") or 0)


class Plan(BaseModel):
    """The cluster's Serve config and the GPU worker group sized to hold it."""

    serve_config: dict[str, Any]
    min_workers: int
    max_workers: int


def plan(serve_config: dict[str, Any], profile: ClusterProfile) -> Plan:
    """Adapt the GPU Serve config to the cluster (see the module doc) and size the GPU group.

    Without explicit worker bounds the group is sized from the Serve autoscaling bounds, so
    every replica Serve may ask for has a GPU; with bounds (a small dev cluster) the Serve
    bounds are clamped to what the group can hold instead.
    """
    config = copy.deepcopy(serve_config)
    # Direct ingress runs Serve's proxy on the head only; the routers serve SERVE_PORT.
    config["proxy_location"] = "HeadOnly"
    config["http_options"] = {
        **(config.get("http_options") or {}),
        "host": "0.0.0.0",
        "port": PROXY_PORT_HEAD,
    }
    gpu_min = gpu_max = 0.0
    for app in config["applications"]:
        for deployment in app.get("deployments") or []:
            gpus = _gpus(deployment)
            if gpus <= 0:
                continue
            per_node = max(1, int(profile.worker.gpus // gpus))
            scaling = dict(deployment.get("autoscaling_config") or {})
            if not scaling:
                fixed = deployment.pop("num_replicas", None)
                start = fixed if isinstance(fixed, int) else 1
                scaling = {
                    "min_replicas": start,
                    "max_replicas": max(start, (profile.max_workers or start) * per_node),
                    **profile.serve_autoscaling.model_dump(),
                }
            if profile.max_workers is not None:
                capacity = profile.max_workers * per_node
                for key in ("min_replicas", "initial_replicas", "max_replicas"):
                    if key in scaling:
                        scaling[key] = min(scaling[key], capacity)
            deployment["autoscaling_config"] = scaling
            gpu_min += scaling.get("min_replicas", 1) * gpus
            gpu_max += scaling["max_replicas"] * gpus
    per_worker = profile.worker.gpus
    min_workers = profile.min_workers
    if min_workers is None:
        min_workers = math.ceil(gpu_min / per_worker)
    max_workers = profile.max_workers
    if max_workers is None:
        max_workers = max(1, math.ceil(gpu_max / per_worker))
    return Plan(serve_config=config, min_workers=min_workers, max_workers=max_workers)
