"""`build_app`: what `serve_config.yaml`'s `import_path` points at.

`serve run serve_config.yaml` calls `build_app(args)`; args are validated as `ServeConfig`
(errors name the bad key) and become one router (ingress) plus the model replicas, whose
handle places requests with `AdapterAffinityRouter`, and the catalog epoch every router
watches (deployments/catalog/epoch.py). Replica count, autoscaling and resources come from
the YAML's `deployments` section, so the same code runs one CPU replica or many GPUs.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from deployments.api.ingress import Router
from deployments.catalog.epoch import CatalogEpoch
from deployments.config import REPO_ROOT, ConfigError, ServeConfig
from deployments.replica.deployment import ModelReplica
from deployments.replica.serve_env import unpinned_direct_ingress

AFFINITY_ROUTER = "deployments.placement.request_router:AdapterAffinityRouter"
DEFAULT_ROUTER = "deployments.placement.request_router:TargetingPowerOfTwoRouter"
logger = logging.getLogger("ray.serve")


def router_config(cfg: ServeConfig) -> RequestRouterConfig:
    """Placement of the model handle: adapter affinity, or Ray's default for comparison."""
    period = cfg.placement.stats_period_s
    common = {
        "request_routing_stats_period_s": period,
        "request_routing_stats_timeout_s": max(5.0, 4 * period),
    }
    if cfg.placement.policy == "default":  # Ray's own placement, able to reach one replica
        return RequestRouterConfig(request_router_class=DEFAULT_ROUTER, **common)
    return RequestRouterConfig(
        request_router_class=AFFINITY_ROUTER,
        request_router_kwargs={
            "load_bound": cfg.placement.load_bound,
            "load_bound_ratio": cfg.placement.load_bound_ratio,
            "placement_memory_s": cfg.placement.placement_memory_s,
        },
        **common,
    )


def check_environment(cfg: ServeConfig) -> None:
    """Fail at `serve run` time, naming the key, for what validation cannot see; warn when the
    router will not serve on its documented port."""
    if (why := unpinned_direct_ingress()) is not None:
        logger.warning(why)
    for missing in cfg.store.missing_dirs():
        raise ConfigError(
            f"invalid serve config:\n  args.store: directory {missing} does not exist"
        )
    auth = cfg.server.auth
    if auth.enabled and auth.keys_file:
        keys = Path(auth.keys_file).expanduser()
        keys = keys if keys.is_absolute() else REPO_ROOT / keys
        if not keys.is_file():
            raise ConfigError(
                f"invalid serve config:\n  args.server.auth.keys_file: file {keys} does not exist"
                " (create it with `molora keys create`)"
            )


def build(
    cfg: ServeConfig,
    replica_options: dict[str, Any] | None = None,
    router_options: dict[str, Any] | None = None,
) -> Application:
    """The app from a validated config; options override deployment settings (tests, bench)."""
    check_environment(cfg)
    # The writable store is fixed here, so routers and replicas agree whatever their environment.
    config = cfg.model_copy(update={"store": cfg.store.pinned()}).model_dump(mode="json")
    model = ModelReplica.options(
        request_router_config=router_config(cfg), **(replica_options or {})
    ).bind(config)
    return Router.options(**(router_options or {})).bind(model, config, CatalogEpoch.bind())


def build_app(args: dict[str, Any] | None = None) -> Application:
    """Serve's application builder: `import_path: deployments.app:build_app`."""
    return build(ServeConfig.from_args(args))
