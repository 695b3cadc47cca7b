"""`ServeConfig`: what `serve_config.yaml`'s `args` hold, validated before anything starts.

One pydantic tree drives the app builder, tests and the benchmark, so a typo in the YAML fails
at `serve run` with the key path named instead of surfacing later inside a replica.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import Field, ValidationError, field_validator, model_validator

from adapter_store.backends.layered import LAYER_SEP
from adapter_store.config import PEFT_PREFIX, RO_PREFIX, user_store_dir
from molora_runtime.config import EngineConfig, StrictModel
from molora_runtime.routes import RouteSpec, check_ref
from molora_runtime.sizes import ByteSize

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_STORE = "deployments/default_store"
AUTO = "auto"


# ---- the access settings (deployments/access/ acts on them) ------------------------------------


class KeyHolder(Protocol):
    """Who a quota is looked up for: an authenticated key (deployments/access/auth.Principal)."""

    key_id: str
    tenant: str | None


class AuthConfig(StrictModel):
    """`server.auth`: off for the local default; on, every API call needs a Bearer key."""

    enabled: bool = Field(False, description="require `Authorization: Bearer <key>`")
    keys_file: str | None = Field(
        None, description="JSON/YAML key file (e.g. a mounted Kubernetes Secret); relative paths "
        "are taken from the repository root",
    )  # fmt: skip
    keys_env: str | None = Field(
        None, description="environment variable holding the key file's content instead"
    )
    reload_s: float = Field(10.0, gt=0, description="how often the key file is checked for change")

    @model_validator(mode="after")
    def _source(self) -> AuthConfig:
        if self.enabled and not (self.keys_file or self.keys_env):
            raise ValueError("auth is enabled but neither keys_file nor keys_env is set")
        if self.keys_file and self.keys_env:
            raise ValueError("set keys_file or keys_env, not both")
        return self


class Limits(StrictModel):
    """Limits of one key; unset fields inherit (key → tenant → default); null = unlimited."""

    requests_per_min: float | None = Field(None, gt=0, description="request rate and burst")
    tokens_per_min: float | None = Field(None, gt=0, description="prompt + completion tokens")
    max_concurrent: int | None = Field(None, ge=1, description="requests (streams) in flight")


class QuotaConfig(StrictModel):
    """`server.quotas`: defaults for every key, overridden per tenant, then per key id."""

    default: Limits = Field(default_factory=Limits)
    tenants: dict[str, Limits] = Field(default_factory=dict)
    keys: dict[str, Limits] = Field(default_factory=dict, description="by key_id")

    def limits_for(self, principal: KeyHolder) -> Limits:
        merged = self.default.model_dump()
        for layer in (self.tenants.get(principal.tenant or ""), self.keys.get(principal.key_id)):
            if layer is not None:
                merged.update({k: getattr(layer, k) for k in layer.model_fields_set})
        return Limits(**merged)


class AdmissionConfig(StrictModel):
    """`server.admission`: what a connection may hold before and while its body arrives."""

    body_timeout_s: float = Field(
        10.0, gt=0, description="the whole request body must arrive within this (else 408)"
    )
    header_timeout_s: float = Field(
        10.0, gt=0, description="a request's line and headers must arrive within this (else 408)"
    )
    max_connections_per_key: int = Field(
        64, ge=1, description="open API requests of one key, any path, bodies still arriving too"
    )


class ConfigError(ValueError):
    """`serve_config.yaml` args are invalid; the message names every bad key path."""


class StoreConfig(StrictModel):
    """Where adapters and compositions live, and where runtime writes (loads, yanks) go."""

    url: str = Field(
        DEFAULT_STORE,
        description="local directory, s3://bucket/prefix, or peft:<directory or s3 prefix> "
        "(a read-only folder of PEFT adapters: Ray Serve LLM's dynamic_lora_loading_path)",
    )
    layers: list[str] = Field(
        default_factory=list,
        description="more read-only stores searched after `url` (same forms); a name's "
        "versions in every layer are its versions",
    )
    writable: str | None = Field(
        AUTO,
        description="where runtime loads and yanks are written: 'auto' = `url` itself, except "
        "that the bundled default store stays read-only (writes go to the user data store, "
        "$MOLORA_HOME/data/store or $XDG_DATA_HOME/molora/store) and a peft: store is "
        "read-only; a directory or s3://bucket/prefix layered over `url`; null = read-only",
    )
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
    reload_share: float = Field(
        0.02,
        gt=0,
        le=1,
        description="the most of one core a router's background catalog reload may take: a "
        "store whose listing takes more CPU than refresh_s x this is re-listed less often "
        "(changes made through the API apply at once either way)",
    )

    @field_validator("url")
    @classmethod
    def _non_empty(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("store url must not be empty")
        return value

    @field_validator("url", "layers", "writable")
    @classmethod
    def _one_store_each(cls, value: str | list[str] | None) -> str | list[str] | None:
        for item in value if isinstance(value, list) else [value]:
            if item is not None and (LAYER_SEP in item or not item.strip()):
                raise ValueError(
                    f"{item!r}: name one store per entry (list more under store.layers)"
                )
        return value

    def layer_urls(self) -> tuple[str | None, list[str]]:
        """The writable store (None: read-only) and the stores read below it, resolved."""
        read = [_resolve(u) for u in (self.url, *self.layers)]
        if self.writable != AUTO:
            return (_resolve(self.writable) if self.writable else None), read
        if read[0] == str(REPO_ROOT / DEFAULT_STORE):
            return str(user_store_dir()), read
        if read[0].startswith(PEFT_PREFIX):
            return None, read
        return read[0], read

    def resolved_url(self) -> str:
        """The one store URL `adapter_store.open_backend` opens: `url` alone, or layers
        `TOP|LOWER|...` (relative local paths are taken from the repository root)."""
        top, read = self.layer_urls()
        if top is None:
            first = read[0] if read[0].startswith((PEFT_PREFIX, RO_PREFIX)) else RO_PREFIX + read[0]
            parts = [first, *read[1:]]
        else:
            parts = read if top == read[0] else [top, *read]
        return LAYER_SEP.join(parts)

    def pinned(self) -> StoreConfig:
        """A copy whose `auto` writable store is the concrete one of this process, so every
        replica and router (whatever its environment) writes to the same place."""
        top, _ = self.layer_urls()
        return self.model_copy(update={"writable": top})

    def missing_dirs(self) -> list[str]:
        """Local directories the read layers name that do not exist."""
        out = []
        for url in self.layer_urls()[1]:
            plain = url.removeprefix(PEFT_PREFIX).removeprefix(RO_PREFIX)
            if "://" not in plain and not Path(plain).is_dir():
                out.append(plain)
        return out


def _resolve(url: str) -> str:
    """A store URL with relative local paths taken from the repository root."""
    for prefix in (PEFT_PREFIX, RO_PREFIX):
        if url.startswith(prefix):
            return prefix + _resolve(url[len(prefix) :])
    if "://" in url:
        return url
    path = Path(url).expanduser()
    return str(path if path.is_absolute() else REPO_ROOT / path)


class PlacementConfig(StrictModel):
    """How the model handle places requests on replicas."""

    policy: Literal["affinity", "default"] = Field(
        "affinity", description="'affinity' = hot-set aware router; 'default' = Ray's power-of-two"
    )
    load_bound: int = Field(
        4,
        ge=0,
        description="a replica is eligible when its load <= the other open replicas' average load "
        "+ this bound",
    )
    load_bound_ratio: float = Field(
        0.25, ge=0, description="... or + this fraction of that average, whichever is larger"
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
