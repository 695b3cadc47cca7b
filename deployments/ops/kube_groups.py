"""The sizes a KubeRay cluster is generated from: pod resources, GPU worker groups, and Serve
autoscaling defaults (validated, so a bad profile fails at render time)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PodResources(_Strict):
    """Requests == limits: Ray sizes its resources from the container, so give it the truth."""

    cpu: str = Field(..., description="Kubernetes quantity, e.g. '8' or '500m'")
    memory: str = Field(..., description="Kubernetes quantity, e.g. '32Gi'")
    gpus: int = Field(0, ge=0, description="nvidia.com/gpu per pod")

    def to_k8s(self) -> dict[str, dict[str, Any]]:
        quantities: dict[str, Any] = {"cpu": self.cpu, "memory": self.memory}
        if self.gpus:
            quantities["nvidia.com/gpu"] = str(self.gpus)
        return {"requests": dict(quantities), "limits": dict(quantities)}


class GpuGroup(_Strict):
    """A worker group of one GPU type: pods land on nodes with that GPU (node label), and Ray
    advertises a `gpu_<type>` resource a deployment can ask for to be placed there."""

    gpu_type: str = Field(..., pattern=r"^[a-z0-9]+$", description="e.g. l4, a100")
    product: str = Field(..., description="the node label nvidia.com/gpu.product")
    worker: PodResources
    max_workers: int = Field(2, ge=1, description="upper bound; the group starts at zero")


class ServeAutoscaling(_Strict):
    """Serve's per-deployment autoscaling, applied to GPU deployments that set none."""

    target_ongoing_requests: float = Field(8, gt=0, description="per replica")
    upscale_delay_s: float = Field(30, ge=0)
    downscale_delay_s: float = Field(300, ge=0)
