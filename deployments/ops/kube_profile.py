"""The cluster flavours a KubeRay manifest is rendered for (base and dev) and their fixed ports."""

from __future__ import annotations

from pydantic import Field, model_validator

from deployments.ops.kube_groups import GpuGroup, PodResources, ServeAutoscaling, _Strict
from deployments.ops.kube_ha import HighAvailability
from deployments.replica.serve_env import PROXY_PORT, ROUTER_PORT

SERVE_PORT = ROUTER_PORT  # each worker's router serves the API here (direct ingress)
PROXY_PORT_HEAD = PROXY_PORT  # Serve's proxy, on the head only
METRICS_PORT = 8080
API_KEYS_DIR = "/etc/molora/api-keys"  # where the API key Secret is mounted in every pod
APP_LABEL = "molora-serve"


class ClusterProfile(_Strict):
    """Size of one cluster flavour (base = production-ish, dev = one small GPU node)."""

    name: str = "molora"
    image: str = Field("molora-serve:latest", description="overlays set the real one (`images:`)")
    head: PodResources = PodResources(cpu="2", memory="8Gi")
    worker: PodResources = PodResources(cpu="8", memory="32Gi", gpus=1)
    gpu_type: str = Field("l4", pattern=r"^[a-z0-9]+$", description="the sized group's GPU")
    gpu_product: str = Field("NVIDIA-L4", description="its node label nvidia.com/gpu.product")
    extra_gpu_groups: tuple[GpuGroup, ...] = Field(
        (), description="more GPU types, scaled from zero by the Ray autoscaler"
    )
    ha: HighAvailability = HighAvailability()
    min_workers: int | None = Field(None, ge=0, description="default: Serve's min replicas")
    max_workers: int | None = Field(None, ge=1, description="default: Serve's max replicas")
    worker_idle_timeout_s: int = Field(300, ge=0, description="Ray autoscaler scale-down delay")
    serve_autoscaling: ServeAutoscaling = ServeAutoscaling()
    store_config_map: str = "molora-adapter-store"
    s3_secret: str = "molora-s3-credentials"
    ray_auth_secret: str = Field(
        "molora-ray-auth-token", description="Secret with key `auth_token`: Ray's cluster token"
    )
    api_keys_secret: str = Field(
        "molora-api-keys", description="Secret with key `keys.json`: the hashed API key file"
    )

    @model_validator(mode="after")
    def _bounds(self) -> ClusterProfile:
        if (self.min_workers or 0) > (self.max_workers or self.min_workers or 0):
            raise ValueError("min_workers must be <= max_workers")
        if self.worker.gpus < 1:
            raise ValueError("the worker group is the GPU group: worker.gpus must be >= 1")
        return self


BASE = ClusterProfile(
    extra_gpu_groups=(
        GpuGroup(
            gpu_type="a100",
            product="NVIDIA-A100-SXM4-80GB",
            worker=PodResources(cpu="12", memory="96Gi", gpus=1),
        ),
    )
)
DEV = ClusterProfile(
    head=PodResources(cpu="1", memory="4Gi"),
    worker=PodResources(cpu="6", memory="24Gi", gpus=1),
    min_workers=0,
    max_workers=1,
    worker_idle_timeout_s=120,
)
