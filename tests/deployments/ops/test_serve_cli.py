"""`molora serve MODEL [vLLM-style flags]`: the flags become the shipped Serve document with a
validated `ServeConfig`, LoRA modules are published once, and the result serves them."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import httpx
import pytest
import yaml

from adapter_store import open_registry
from deployments.config import ServeConfig
from deployments.ops import cli, serve_cli
from tests.deployments.serve_helpers import deploy, undeploy

MESSAGES = [{"role": "user", "content": "Say something."}]


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_cli.register(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def _folder(store: Path, name: str) -> Path:
    m = open_registry(str(store)).resolve("adapter", name)
    return store / "adapters" / name / m.version / m.blob_dir


def test_flags_map_onto_the_validated_config(capsys, tiny_assets, tmp_path) -> None:
    argv = [str(tiny_assets["model"]), "--max-loras", "6", "--max-lora-rank", "32"]
    argv += ["--max-num-seqs", "12", "--max-model-len", "512", "--dtype", "float32"]
    argv += ["--served-model-name", "mine", "--port", "8123", "--num-replicas", "2"]
    argv += ["--store", str(tmp_path / "store"), "--enable-lora", "--print-config"]
    assert cli.main(argv=["serve", *argv]) == 0
    out = capsys.readouterr().out
    doc = yaml.safe_load(out)
    app = doc["applications"][0]
    cfg = ServeConfig.from_args(app["args"])
    assert cfg.engine.hot_set.num_slots == 6 and cfg.engine.hot_set.max_rank == 32
    assert cfg.engine.max_num_seqs == 12 and cfg.engine.max_model_len == 512
    assert cfg.engine.dtype == "float32" and cfg.served_model_name == "mine"
    assert cfg.store.url == str(tmp_path / "store")
    # The embedded model's named routes pin its own adapters: not carried to another model.
    assert cfg.expose.routes == {}
    # The router serves --port itself (the cluster's environment pins it; the printed header
    # says so) and Serve's proxy the next one.
    assert doc["http_options"] == {**doc["http_options"], "port": 8124, "host": "127.0.0.1"}
    header = out.splitlines()[0]
    assert "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT=8123" in header
    assert "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT=8124" in header
    assert app["runtime_env"]["env_vars"]["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    replica = next(d for d in app["deployments"] if d["name"] == "ModelReplica")
    assert replica["num_replicas"] == 2 and replica["max_ongoing_requests"] == 13
    assert app["import_path"] == "deployments.app:build_app"


def test_the_embedded_default_keeps_the_bundled_store(capsys) -> None:
    assert cli.main(argv=["serve", "smollm2-135m-instruct", "--print-config"]) == 0
    shipped = yaml.safe_load((serve_cli.TEMPLATE).read_text())
    assert yaml.safe_load(capsys.readouterr().out) == shipped


def test_proxy_ingress_switch_serves_the_port_through_serves_proxy(capsys) -> None:
    argv = ["serve", "smollm2-135m-instruct", "--port", "9100", "--no-direct-ingress"]
    assert cli.main(argv=[*argv, "--print-config"]) == 0
    out = capsys.readouterr().out
    doc = yaml.safe_load(out)
    assert doc["http_options"]["port"] == 9100
    env = doc["applications"][0]["runtime_env"]["env_vars"]
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "0"
    assert "RAY_SERVE_ENABLE_DIRECT_INGRESS=0" in out.splitlines()[0]
    assert "MIN_HTTP_PORT" not in out


def test_rank_pools_flag_sizes_the_hot_set(capsys) -> None:
    argv = ["smollm2-135m-instruct", "--lora-rank-pools", "64:2,8:8", "--print-config"]
    assert cli.main(argv=["serve", *argv]) == 0
    doc = yaml.safe_load(capsys.readouterr().out)
    hot = ServeConfig.from_args(doc["applications"][0]["args"]).engine.hot_set
    assert [(p.rank, p.slots) for p in hot.rank_pools] == [(8, 8), (64, 2)]
    assert hot.num_slots == 10 and hot.max_rank == 64


def test_speculative_config_flag_takes_vllms_json(capsys) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}
    argv = ["smollm2-135m-instruct", "--speculative-config", json.dumps(spec), "--print-config"]
    assert cli.main(argv=["serve", *argv]) == 0
    doc = yaml.safe_load(capsys.readouterr().out)
    got = ServeConfig.from_args(doc["applications"][0]["args"]).engine.speculative
    assert got is not None
    assert (got.method, got.num_speculative_tokens, got.prompt_lookup_max) == ("ngram", 3, 5)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--tensor-parallel-size", "2"], "--tensor-parallel-size is not supported"),
        (["--api-key", "k"], "server.auth"),
        (["--lora-modules", "noequals"], "takes name=path"),
        (["--lora-modules", '{"name": 1}'], "must be"),
        (["--lora-modules", "a=x", "a=y"], "names 'a' twice"),
        (["--max-num-seqs", "0"], "max_num_seqs"),
        (["--chat-template", "no-such-template"], "--chat-template: chat_template"),
        (["--tool-call-parser", "mistral"], "invalid choice"),
        (["--lora-rank-pools", "8"], "expected RANK:SLOTS"),
        (["--lora-rank-pools", "8:2,x:1"], "expected RANK:SLOTS"),
        (["--lora-rank-pools", "0:2"], "greater than or equal to 1"),
        (["--lora-rank-pools", "8:2,8:1"], "repeats a rank"),
        (["--lora-rank-pools", "8:2", "--max-loras", "3"], "num_slots=3"),
        (["--speculative-config", "{ngram"], "is not JSON"),
        (["--speculative-config", "[1]"], "must be a JSON object"),
        (["--speculative-config", '{"method": "eagle"}'], "method"),
        (["--speculative-config", '{"model": "x/eagle"}'], "draft model is not supported"),
        (["--speculative-config", '{"num_speculative_tokens": 99}'], "num_speculative_tokens"),
    ],
)
def test_bad_flags_say_why(argv, says, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv=["serve", "smollm2-135m-instruct", *argv, "--print-config"])
    assert exit_.value.code != 0
    err = capsys.readouterr().err + str(exit_.value.code)
    assert says in err


def test_chat_template_flag(capsys, tmp_path, monkeypatch) -> None:
    """A shipped name passes as is; a file is carried by its absolute path (the replicas run
    elsewhere); vLLM's tool flags are accepted."""
    (tmp_path / "mine.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    monkeypatch.chdir(tmp_path)
    for value, want in (("hermes", "hermes"), ("mine.jinja", str(tmp_path / "mine.jinja"))):
        argv = ["smollm2-135m-instruct", "--chat-template", value, "--enable-auto-tool-choice"]
        argv += ["--tool-call-parser", "hermes", "--print-config"]
        assert cli.main(argv=["serve", *argv]) == 0
        args = yaml.safe_load(capsys.readouterr().out)["applications"][0]["args"]
        assert ServeConfig.from_args(args).engine.chat_template == want


def test_unknown_model_is_refused(tmp_path) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv=["serve", str(tmp_path / "nope"), "--print-config"])
    assert "neither a prepared alias nor a model folder" in str(exit_.value.code)


def test_lora_modules_publish_once_and_refuse_bad_adapters(tiny_assets, tmp_path) -> None:
    src = Path(shutil.copytree(_folder(tiny_assets["store"], "math"), tmp_path / "mine"))
    store = tmp_path / "store"
    args = _args(str(tiny_assets["model"]), "--store", str(store), "--lora-modules", f"mine={src}")
    doc = serve_cli.build_document(args)
    assert serve_cli.publish_modules(doc, args.lora_modules) == ["mine@v1"]
    # Unchanged files: the same version is served again, nothing is published.
    assert serve_cli.publish_modules(doc, args.lora_modules) == ["mine@v1"]
    config = json.loads((src / "adapter_config.json").read_text())
    config["lora_alpha"] = config["lora_alpha"] * 2
    (src / "adapter_config.json").write_text(json.dumps(config))
    assert serve_cli.publish_modules(doc, args.lora_modules) == ["mine@v2"]
    # An adapter for another model's shapes is refused by the store's rulebook, by name.
    (src / "adapter_config.json").write_text(json.dumps({**config, "r": "eight"}))
    with pytest.raises(serve_cli.ConfigError, match="--lora-modules mine"):
        serve_cli.publish_modules(doc, args.lora_modules)


def test_a_published_module_is_served(ray_cluster, tiny_assets, tmp_path) -> None:
    url = ray_cluster["url"]
    src = shutil.copytree(_folder(tiny_assets["store"], "math"), tmp_path / "mine")
    argv = [str(tiny_assets["model"]), "--store", str(tmp_path / "store"), "--dtype", "float32"]
    args = _args(*argv, "--served-model-name", "tiny-base", "--lora-modules", f"mine={src}")
    doc = serve_cli.build_document(args)
    serve_cli.publish_modules(doc, args.lora_modules)
    app = doc["applications"][0]
    replica = next(d for d in app["deployments"] if d["name"] == "ModelReplica")
    options = {k: v for k, v in replica.items() if k != "name"}
    options["ray_actor_options"] = {"num_cpus": 1}
    deploy(url, app["args"], options)
    try:
        models = httpx.get(f"{url}/v1/models", timeout=30).json()
        assert {"tiny-base", "mine"} <= {m["id"] for m in models["data"]}
        body = {"model": "mine", "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
        missing = httpx.post(
            f"{url}/v1/chat/completions", json={**body, "model": "math"}, timeout=60
        )
        assert missing.status_code == 404  # only the modules given are served
    finally:
        undeploy()
