"""What keeps a multi-node KubeRay deployment serving through node loss, upgrades and a head
restart: a PodDisruptionBudget for the GPU workers, the RayService upgrade strategy, and GCS
fault tolerance on an external Redis (the head's cluster state survives a head pod restart, and
Serve keeps answering from the workers while the head is away).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class HighAvailability(BaseModel):
    """The RayService's HA settings (defaults: a Redis Service `molora-redis` in the namespace)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    redis_address: str = Field(
        "redis://molora-redis:6379", description="external Redis for GCS fault tolerance"
    )
    redis_secret: str = Field(
        "molora-redis-password", description="Secret with key `password`: the Redis password"
    )
    upgrade: str = Field(
        "NewCluster",
        description="KubeRay upgrade strategy for rayClusterConfig changes: a new cluster is "
        "brought up and the Service switched when it serves (serveConfigV2-only changes are "
        "rolled in place by Serve)",
    )
    max_unavailable_workers: int = Field(
        1, ge=0, description="voluntary disruptions (drains) take at most this many GPU workers"
    )


def gcs_fault_tolerance(ha: HighAvailability) -> dict[str, Any]:
    """`rayClusterConfig.gcsFaultToleranceOptions`: the password from a Secret, never inline."""
    return {
        "redisAddress": ha.redis_address,
        "redisPassword": {
            "valueFrom": {"secretKeyRef": {"name": ha.redis_secret, "key": "password"}}
        },
    }


def upgrade_strategy(ha: HighAvailability) -> dict[str, Any]:
    return {"type": ha.upgrade}


def worker_pdb(name: str, labels: dict[str, str], ha: HighAvailability) -> dict[str, Any]:
    """A PodDisruptionBudget over every GPU worker pod of the RayService."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {
            "name": f"{name}-gpu-workers",
            "labels": {"app.kubernetes.io/name": labels["app.kubernetes.io/name"]},
        },
        "spec": {
            "maxUnavailable": ha.max_unavailable_workers,
            "selector": {"matchLabels": labels},
        },
    }
