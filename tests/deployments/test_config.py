"""serve_config.yaml files and ServeConfig validation (errors name the bad key path)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from deployments.app import router_config
from deployments.config import ConfigError, ServeConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["serve_config.yaml", "serve_config.gpu.yaml"])
def test_shipped_configs_validate(name):
    data = yaml.safe_load((ROOT / name).read_text())
    ServeDeploySchema.model_validate(data)
    app = data["applications"][0]
    assert app["import_path"] == "deployments.app:build_app"
    cfg = ServeConfig.from_args(app["args"])
    assert cfg.placement.policy == "affinity"
    names = {d["name"] for d in app["deployments"]}
    assert names == {"ModelReplica", "Router"}


def test_default_config_is_cpu_loopback_embedded_model():
    data = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    # Loopback: the router's own server (:8000, direct ingress) binds this host too; Serve's
    # proxy keeps the port next to it.
    assert data["http_options"] == {**data["http_options"], "host": "127.0.0.1", "port": 8001}
    app = data["applications"][0]
    cfg = ServeConfig.from_args(app["args"])
    assert cfg.engine.device == "cpu"
    assert cfg.engine.model == "smollm2-135m-instruct"
    assert cfg.store.url == "deployments/default_store"
    replica = next(d for d in app["deployments"] if d["name"] == "ModelReplica")
    # Replicas own every core of the 2-core default box from the first request (one 2-CPU
    # engine: the measured default; see the comment in serve_config.yaml).
    assert "autoscaling_config" not in replica
    assert replica["num_replicas"] * replica["ray_actor_options"]["num_cpus"] == 2
    assert cfg.engine.max_num_seqs >= 32


def test_gpu_config_uses_gpus_and_s3():
    app = yaml.safe_load((ROOT / "serve_config.gpu.yaml").read_text())["applications"][0]
    replica = next(d for d in app["deployments"] if d["name"] == "ModelReplica")
    assert replica["ray_actor_options"]["num_gpus"] == 1
    assert app["args"]["store"]["url"].startswith("s3://")


@pytest.mark.parametrize(
    ("args", "path"),
    [
        ({"engine": {"max_num_seqs": 0}}, "args.engine.max_num_seqs"),
        ({"engine": {"hot_set": {"num_slot": 3}}}, "args.engine.hot_set.num_slot: unknown key"),
        ({"placment": {}}, "args.placment: unknown key"),
        ({"placement": {"policy": "random"}}, "args.placement.policy"),
        ({"expose": {"adapters": ["Bad Name"]}}, "args.expose.adapters"),
        ({"expose": {"routes": {"r": {"kind": "mix", "weights": {}}}}}, "args.expose.routes.r"),
    ],
)
def test_bad_args_name_the_key(args, path):
    with pytest.raises(ConfigError) as info:
        ServeConfig.from_args(args)
    assert path in str(info.value)


def test_router_config_follows_policy():
    affinity = router_config(ServeConfig())
    assert affinity.request_router_class.endswith("AdapterAffinityRouter")
    assert affinity.request_router_kwargs["load_bound"] == 4
    default = router_config(ServeConfig.from_args({"placement": {"policy": "default"}}))
    assert "PowerOfTwo" in str(default.request_router_class)


def test_relative_store_url_is_taken_from_repo_root():
    cfg = ServeConfig.from_args({"store": {"writable": None}})
    assert cfg.store.resolved_url() == f"ro:{ROOT / 'deployments' / 'default_store'}"
    s3 = ServeConfig.from_args({"store": {"url": "s3://b/p"}})
    assert s3.store.resolved_url() == "s3://b/p"
    rel = ServeConfig.from_args({"store": {"url": "mine", "layers": ["peft:loras"]}})
    assert rel.store.resolved_url() == f"{ROOT / 'mine'}|peft:{ROOT / 'loras'}"


def test_the_bundled_store_is_a_read_only_layer_under_the_user_store(tmp_path, monkeypatch):
    monkeypatch.setenv("MOLORA_HOME", str(tmp_path))
    cfg = ServeConfig()
    bundled = ROOT / "deployments" / "default_store"
    assert cfg.store.resolved_url() == f"{tmp_path / 'data' / 'store'}|{bundled}"
    # Pinned at build time, so every process writes to the same place.
    assert cfg.store.pinned().writable == str(tmp_path / "data" / "store")
    peft = ServeConfig.from_args({"store": {"url": "peft:s3://b/loras"}})
    assert peft.store.resolved_url() == "peft:s3://b/loras"  # read-only by nature
    own = ServeConfig.from_args({"store": {"url": "peft:s3://b/l", "writable": "s3://b/w"}})
    assert own.store.resolved_url() == "s3://b/w|peft:s3://b/l"
    with pytest.raises(ConfigError, match="one store per entry"):
        ServeConfig.from_args({"store": {"url": "a|b"}})
