"""Helpers of the serving tests: the shipped config pointed at tiny assets, deploy, handles."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[2]
APP = "molora"


def shipped_args(tiny_assets: dict[str, Path], **overrides: Any) -> dict[str, Any]:
    """The args of the shipped serve_config.yaml, pointed at the tiny model and store."""
    app = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]
    args = app["args"]
    args["engine"]["model"] = str(tiny_assets["model"])
    # Tests compare texts token for token across batch compositions: fp32 keeps that exact
    # (the shipped default is `auto`, bf16 on CPUs with native bf16 math).
    args["engine"]["dtype"] = "float32"
    args["store"] = {"url": str(tiny_assets["store"]), "cache_dir": str(tiny_assets["cache"])}
    args["served_model_name"] = "tiny-base"
    for key, value in overrides.items():
        section = args.setdefault(key, {})
        if isinstance(value, dict) and isinstance(section, dict):
            _merge(section, value)
        else:
            args[key] = value
    return args


def _merge(into: dict[str, Any], new: dict[str, Any]) -> None:
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v


def shipped_replica_options(**overrides: Any) -> dict[str, Any]:
    app = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]
    options = next(d for d in app["deployments"] if d["name"] == "ModelReplica")
    options = {k: v for k, v in options.items() if k != "name"}
    options.update(overrides)
    return options


def deploy(url: str, args: dict[str, Any], replica_options: dict[str, Any]) -> None:
    from ray import serve

    from deployments.app import build
    from deployments.config import ServeConfig

    app = build(ServeConfig.from_args(args), replica_options=replica_options)
    serve.run(app, name=APP, route_prefix="/", blocking=False)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=10).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("the app did not become healthy")


def undeploy() -> None:
    from ray import serve

    serve.delete(APP)


def model_handle():
    from ray import serve

    return serve.get_deployment_handle("ModelReplica", app_name=APP)
