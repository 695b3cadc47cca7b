"""`ServeConfig`: what `serve_config.yaml`'s `args` hold, validated before anything starts.

One pydantic tree drives the app builder, tests and the benchmark, so a typo in the YAML fails
at `serve run` with the key path named instead of surfacing later inside a replica.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from deployments.access.admission import AdmissionConfig
from deployments.access.auth import AuthConfig
from deployments.access.quotas import QuotaConfig
from molora_runtime.config import EngineConfig, StrictModel
from molora_runtime.routes import RouteSpec, check_ref
from molora_runtime.sizes import ByteSize

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_STORE = "deployments/default_store"


class ConfigError(ValueError):
    """`serve_config.yaml` args are invalid; the message names every bad key path."""


class StoreConfig(StrictModel):
    """Where adapters and compositions live (a local registry directory or `s3://bucket/prefix`)."""

    url: str = Field(DEFAULT_STORE, description="local directory or s3://bucket/prefix")
    endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, SeaweedFS)")
    cache_dir: str | None = Field(
        None, description="local verified cache; default under MOLORA_HOME"
    )
    cache_bytes: ByteSize = Field(
        10 * 2**30,
        ge=0,
        description="disk cache size before LRU eviction (pinned adapters stay); an integer "
        "or e.g. '10GiB'",
    )
    refresh_s: float = Field(10.0, gt=0, description="how long the ingress caches the registry")

    @field_validator("url")
    @classmethod
    def _non_empty(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("store url must not be empty")
        return value

    def resolved_url(self) -> str:
        """Relative local paths are taken from the repository root so `serve run` works anywhere."""
        if "://" in self.url:
            return self.url
        path = Path(self.url).expanduser()
        return str(path if path.is_absolute() else REPO_ROOT / path)


class PlacementConfig(StrictModel):
    """How the model handle places requests on replicas."""

    policy: Literal["affinity", "default"] = Field(
        "affinity", description="'affinity' = hot-set aware router; 'default' = Ray's power-of-two"
    )
    load_bound: int = Field(
        4, ge=0, description="a replica is eligible when its load <= least load + this bound"
    )
    load_bound_ratio: float = Field(
        0.25, ge=0, description="... or + this fraction of the least load, whichever is larger"
    )
    stats_period_s: float = Field(0.5, gt=0, description="how often replicas report their hot-set")
    placement_memory_s: float = Field(
        5.0, ge=0, description="how long the router remembers its own placements"
    )


class ExposeConfig(StrictModel):
    """Which names `/v1/models` lists and requests may use."""

    base: bool = Field(True, description="serve the base model under `served_model_name`")
    adapters: list[str] | Literal["all"] = "all"
    compositions: list[str] | Literal["all"] = "all"
    mixes: bool = Field(True, description="accept static mixes `a:0.7+b:0.3` as model names")
    routes: dict[str, RouteSpec] = Field(
        default_factory=dict, description="named routes (aliases) listed as models"
    )

    @field_validator("adapters", "compositions")
    @classmethod
    def _refs(cls, value: list[str] | str) -> list[str] | str:
        if isinstance(value, list):
            for ref in value:
                check_ref(ref)
        return value

    @field_validator("routes")
    @classmethod
    def _route_names(cls, value: dict[str, Any]) -> dict[str, Any]:
        for name in value:
            check_ref(name)
        return value


class RuntimeLoraConfig(StrictModel):
    """vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (publish/yank in the store)."""

    enabled: bool = Field(True, description="serve the two endpoints (admin keys only with auth)")
    load_dir: str | None = Field(
        None,
        description="lora_path folders must lie inside this directory (relative to the repo); "
        "unset = loading from paths is refused, only 'store:NAME[@VERSION]' references load",
    )


class ServerConfig(StrictModel):
    """Limits applied by the ingress before a request reaches a replica."""

    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request omits it")
    max_request_bytes: int = Field(1 << 20, ge=1024)
    max_json_depth: int = Field(
        32, ge=4, le=512, description="deepest JSON nesting a request body may have"
    )
    retry_after_s: int = Field(
        1, ge=1, description="least Retry-After of 429/503 overload answers (the rest is estimated)"
    )
    request_timeout_s: float = Field(600.0, gt=0)
    stream_channels: bool = Field(
        True,
        description="stream every request's tokens from a replica through one multiplexed "
        "channel per router (one Ray message per engine step instead of one per sequence); "
        "false: each request streams on its own call",
    )
    auth: AuthConfig = Field(default_factory=AuthConfig, description="API keys (off by default)")
    quotas: QuotaConfig = Field(default_factory=QuotaConfig, description="per-key limits")
    admission: AdmissionConfig = Field(
        default_factory=AdmissionConfig, description="limits applied before the body is read"
    )
    runtime_lora: RuntimeLoraConfig = Field(
        default_factory=RuntimeLoraConfig, description="vLLM-compatible LoRA load/unload"
    )


class ServeConfig(StrictModel):
    """Everything `build_app` needs; `serve_config.yaml`'s `args` validate against this."""

    engine: EngineConfig = Field(default_factory=lambda: EngineConfig(device="cpu"))
    store: StoreConfig = Field(default_factory=StoreConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    expose: ExposeConfig = Field(default_factory=ExposeConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    served_model_name: str | None = Field(
        None, description="name of the base model in the API; default: the engine's model name"
    )

    @model_validator(mode="after")
    def _name(self) -> ServeConfig:
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("served_model_name must not be empty")
        return self

    def base_model_name(self) -> str:
        return self.served_model_name or Path(self.engine.model).name

    @classmethod
    def from_args(cls, args: dict[str, Any] | None) -> ServeConfig:
        """Validate `args`; the error lists each bad key as a dotted path under `args`."""
        try:
            return cls.model_validate(args or {})
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, root="args")) from None


def format_validation_error(exc: ValidationError, root: str) -> str:
    lines = [f"invalid serve config ({exc.error_count()} error(s)):"]
    for err in exc.errors():
        path = ".".join(str(p) for p in (root, *err["loc"]))
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"  {path}: {msg}")
    return "\n".join(lines)
