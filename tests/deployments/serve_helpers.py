"""Helpers of the serving tests: the shipped config pointed at tiny assets, deploy, handles."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from adapter_store import open_registry
from deployments.access.auth import KeyFile, new_key, write_key_file
from deployments.catalog.model_names import AdapterEntry, Catalog, CompositionEntry, Resolver
from deployments.config import ServeConfig

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
    # The shipped named routes pin adapters of the default store, which the tiny store lacks.
    args.get("expose", {}).pop("routes", None)
    for key, value in overrides.items():
        section = args.setdefault(key, {})
        if isinstance(value, dict) and isinstance(section, dict):
            _merge(section, value)
        else:
            args[key] = value
    return args


def tiny_args(
    tiny_assets: dict[str, Path],
    *,
    seqs: int,
    model_len: int | None = None,
    queue: int | None = None,
    max_tokens: int | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """`shipped_args` with the knobs every serving test sizes: the engine's batch (`seqs`), queue
    and length limits and the server's default max_tokens; `overrides` merge on top."""
    engine: dict[str, Any] = {"max_num_seqs": seqs}
    if queue is not None:
        engine["max_queue_len"] = queue
    if model_len is not None:
        engine["max_model_len"] = model_len
    server: dict[str, Any] = {} if max_tokens is None else {"default_max_tokens": max_tokens}
    _merge(engine, overrides.pop("engine", {}))
    _merge(server, overrides.pop("server", {}))
    return shipped_args(tiny_assets, engine=engine, server=server, **overrides)


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


def deploy(
    url: str,
    args: dict[str, Any],
    replica_options: dict[str, Any],
    router_options: dict[str, Any] | None = None,
) -> None:
    from ray import serve

    from deployments.app import build
    from deployments.config import ServeConfig

    SHARED.release()  # one app name on the cluster: a deploy replaces whatever app held it
    app = build(
        ServeConfig.from_args(args), replica_options=replica_options, router_options=router_options
    )
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


@contextlib.contextmanager
def deployed(
    url: str,
    args: dict[str, Any],
    replicas: int = 1,
    max_ongoing: int = 16,
    routers: int = 1,
    env: dict[str, str] | None = None,
) -> Iterator[None]:
    """The app served from `args` on `replicas` one-CPU model replicas and `routers` router
    replicas (with `env` in their processes), removed after."""
    _deploy_on_replicas(url, args, replicas, max_ongoing, routers, env)
    try:
        yield
    finally:
        undeploy()


def _deploy_on_replicas(
    url: str,
    args: dict[str, Any],
    replicas: int = 1,
    max_ongoing: int = 16,
    routers: int = 1,
    env: dict[str, str] | None = None,
) -> None:
    runtime_env = {"runtime_env": {"env_vars": env}} if env else {}
    options = shipped_replica_options(
        num_replicas=replicas,
        autoscaling_config=None,
        max_ongoing_requests=max_ongoing,
        ray_actor_options={"num_cpus": 1, **runtime_env},
    )
    router = {"num_replicas": routers, "ray_actor_options": {"num_cpus": 0, **runtime_env}}
    deploy(url, args, options, router)


class SharedApp:
    """The one app that several modules serve with the same config, deployed once and kept
    while the modules that ask for it run back to back (a deploy costs two Ray worker starts);
    any other deploy, or `release()`, removes it."""

    def __init__(self) -> None:
        self.key: str | None = None

    def serve(self, cluster: dict[str, Any], args: dict[str, Any], **options: Any) -> str:
        """`cluster`'s URL once the app of `args` (`options` as for `deployed`) is served."""
        key = json.dumps([args, options], sort_keys=True, default=str)
        if key != self.key:
            _deploy_on_replicas(cluster["url"], args, **options)
            self.key = key
        return cluster["url"]

    def release(self) -> None:
        if self.key is not None:
            self.key = None
            undeploy()


SHARED = SharedApp()


def serving(cluster: dict[str, Any], args: dict[str, Any], **options: Any) -> Iterator[str]:
    """A fixture's body: the app from `args` on `cluster` (`options` as for `deployed`) while
    the fixture lives; yields its URL."""
    with deployed(cluster["url"], args, **options):
        yield cluster["url"]


async def whole_chat_seconds(http: httpx.AsyncClient, body: dict[str, Any], tokens: int) -> float:
    """Seconds one unstreamed chat completion of `body` takes; it must write `tokens` tokens."""
    started = time.monotonic()
    whole = await http.post("/v1/chat/completions", json=body)
    seconds = time.monotonic() - started
    assert whole.json()["usage"]["completion_tokens"] == tokens, whole.text
    return seconds


@contextlib.asynccontextmanager
async def open_stream(
    http: httpx.AsyncClient, body: dict[str, Any], lines: int = 3
) -> AsyncIterator[None]:
    """`body` streamed until `lines` data lines came; the `with` body runs while the stream is
    open, and leaving it hangs up mid-stream."""
    async with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        got = 0
        async for line in resp.aiter_lines():
            got += line.startswith("data: ")
            if got == lines:
                yield  # the line iterator stays open until the `with` body is done
                return
        raise AssertionError(f"the stream ended before {lines} data lines")


def openai_client(url: str, api_key: str = "unused") -> Any:
    """The official client against a test app (no retries: a test sees every failure)."""
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=60)


def undeploy() -> None:
    from ray import serve

    serve.delete(APP)


def model_handle():
    from ray import serve

    return serve.get_deployment_handle("ModelReplica", app_name=APP)


def replica_pid(deployment: str) -> int:
    """The process id of the one replica actor of `deployment` (asked of the actor itself)."""
    import ray

    names = [
        entry
        for entry in ray.util.list_named_actors(all_namespaces=True)
        if entry["name"].startswith("SERVE_REPLICA::") and deployment in entry["name"]
    ]
    assert len(names) == 1, names
    actor = ray.get_actor(names[0]["name"], namespace=names[0]["namespace"])
    return int(ray.get(actor.__ray_call__.remote(lambda _self: os.getpid()), timeout=60))


def issue_keys(path: Path, holders: list[tuple[str, str, bool]]) -> dict[str, str]:
    """A key file at `path` with one key per (name, tenant, admin) holder; returns each holder's
    key and key id (`name`, `name_id`)."""
    keys: dict[str, str] = {}
    entries = []
    for name, tenant, admin in holders:
        keys[name], entry = new_key(tenant, admin=admin)
        keys[f"{name}_id"] = entry.key_id
        entries.append(entry)
    write_key_file(path, KeyFile(keys=entries))
    return keys


def keyed_server(
    root: Path,
    holders: list[tuple[str, str, bool]],
    quotas: dict[str, dict[str, int]] | None = None,
) -> tuple[dict[str, str], dict[str, Any]]:
    """Keys for `holders` (as `issue_keys`) in `root/keys.json`, and the server section that
    requires them, with per-key `quotas` given by holder name."""
    keys = issue_keys(root / "keys.json", holders)
    server: dict[str, Any] = {"auth": auth_on(root / "keys.json")}
    if quotas:
        server["quotas"] = {"keys": {keys[f"{who}_id"]: q for who, q in quotas.items()}}
    return keys, server


def auth_on(key_file: Path) -> dict[str, Any]:
    """The server's `auth` section: API keys required, read from `key_file`."""
    return {"enabled": True, "keys_file": str(key_file)}


def store_copy(tiny_assets: dict[str, Path], root: Path) -> Path:
    """A writable copy of the tiny store at `root/store` (the session's store stays as built)."""
    return Path(shutil.copytree(tiny_assets["store"], root / "store"))


def adapter_files(store: Path, name: str = "math") -> Path:
    """The folder of PEFT files of `name`'s current version in the local store at `store`."""
    m = open_registry(str(store)).resolve("adapter", name)
    return store / "adapters" / name / m.version / m.blob_dir


def own_store(store: Path, root: Path) -> dict[str, Any]:
    """The `store` section for a test's own store copy: its cache under `root`, re-read twice a
    second so a publish shows up within the test."""
    return {"url": str(store), "cache_dir": str(root / "cache"), "refresh_s": 0.5}


def runtime_lora(load_dir: Path) -> dict[str, Any]:
    """The server's `runtime_lora` section: loads allowed from `load_dir` (relative to the repo)."""
    return {"load_dir": os.path.relpath(load_dir, ROOT)}


def name_resolver(
    adapter_versions: dict[str, tuple[str, ...]], base: str, **expose: Any
) -> Resolver:
    """The router's model-name resolver, served as `base` with `expose`, over a catalog of the
    adapters (name -> versions, the last one latest) and the `mathcode` composition of
    math@v1 and code@v1."""
    adapters = {n: AdapterEntry(n, v, v[-1]) for n, v in adapter_versions.items()}
    comp = CompositionEntry("mathcode", ("math@v1", "code@v1"), ("v1",), "v1")
    catalog = Catalog(adapters=adapters, compositions={"mathcode": comp})
    return Resolver(ServeConfig.from_args({"served_model_name": base, "expose": expose}), catalog)
