"""`molora serve MODEL [flags]`: the vLLM-style way to start the server on one's own model.

The flags build the same validated `ServeConfig` that `serve_config.yaml` holds, inside the
shipped Serve document (deployments, HTTP options), so a command line and a YAML file can never
describe two different servers. `--print-config` writes that YAML for `serve run` or KubeRay;
otherwise `serve run` is started on it, on a new local Ray cluster (127.0.0.1) unless --address
or RAY_ADDRESS names a running one. `--lora-modules name=path` publishes local PEFT folders
to the store first (validated by the store's rulebook against MODEL), as vLLM loads them at start.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from adapter_store.config import PEFT_PREFIX, user_store_dir
from adapter_store.errors import InvalidInputError, NotFoundError
from adapter_store.validate import load_base_config, sha256_file
from adapter_store.versions import open_registry
from deployments.config import REPO_ROOT, ConfigError, ServeConfig
from deployments.replica.serve_env import (
    ENABLE,
    PROXY_ENV_VARS,
    ROUTER_PORT,
    direct_ingress_env,
    ray_address_env,
)
from molora_runtime.model.chat_templates import (
    SHIPPED_TEMPLATES,
    ChatTemplateError,
    read_chat_template,
)
from molora_runtime.model.model_paths import GGUF_MODELS, resolve_model_path

TEMPLATE = REPO_ROOT / "serve_config.yaml"
DEFAULT_MODEL_ALIAS = "smollm2-135m-instruct"

# vLLM flags a user may bring that have no meaning here, with the reason given instead of
# argparse's "unrecognized arguments".
UNSUPPORTED_VLLM_FLAGS: dict[str, str] = {
    "--tensor-parallel-size": "one replica runs on one device; scale out with --num-replicas",
    "--pipeline-parallel-size": "one replica runs on one device; scale out with --num-replicas",
    "--quantization": "weights are served in --dtype; quantized checkpoints are not loaded",
    "--max-cpu-loras": "the host tier is sized by store.cache_bytes in the YAML",
    "--api-key": "API keys are configured under server.auth (see docs/security.md)",
}


class LoraModule(argparse.Action):
    """`name=path` or vLLM's JSON form `{"name": ..., "path": ...}`, repeatable."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # type: ignore[override]
        modules: dict[str, str] = dict(getattr(namespace, self.dest) or {})
        for value in values:
            name, path = _parse_module(parser, value)
            if name in modules:
                parser.error(f"--lora-modules names {name!r} twice")
            modules[name] = path
        setattr(namespace, self.dest, modules)


def _parse_module(parser: argparse.ArgumentParser, value: str) -> tuple[str, str]:
    if value.lstrip().startswith("{"):
        try:
            obj = json.loads(value)
        except json.JSONDecodeError as exc:
            parser.error(f"--lora-modules: invalid JSON {value!r}: {exc.msg}")
        if (
            not isinstance(obj, dict)
            or not isinstance(obj.get("name"), str)
            or not isinstance(obj.get("path"), str)
        ):
            parser.error('--lora-modules JSON must be {"name": "...", "path": "..."}')
        return obj["name"], obj["path"]
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        parser.error(f"--lora-modules takes name=path, got {value!r}")
    return name, path


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve MODEL with optional LoRA modules (vLLM-style flags)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", help="a prepared alias (e.g. smollm2-135m-instruct) or an HF folder")
    p.add_argument("--lora-modules", nargs="+", action=LoraModule, default={}, metavar="NAME=PATH")
    p.add_argument("--enable-lora", action="store_true", help="accepted for vLLM; always on")
    p.add_argument(
        "--max-loras", type=int, help="hot-set slots per replica (hot_set.num_slots; default auto)"
    )
    p.add_argument("--max-lora-rank", type=int, help="largest adapter rank (hot_set.max_rank)")
    p.add_argument(
        "--lora-rank-pools",
        type=rank_pools,
        metavar="RANK:SLOTS,...",
        help="rank-bucketed slots, e.g. 8:8,64:2 (hot_set.rank_pools; replaces --max-loras "
        "and --max-lora-rank, which then must agree)",
    )
    p.add_argument("--served-model-name", help="the base model's name in the API")
    p.add_argument(
        "--chat-template",
        help="chat template: a shipped name (hermes), a Jinja file, or the Jinja text; "
        "default: the model's own",
    )
    p.add_argument(
        "--enable-auto-tool-choice", action="store_true", help="accepted for vLLM; always on"
    )
    p.add_argument(
        "--tool-call-parser",
        choices=["hermes"],
        help="accepted for vLLM: the <tool_call> JSON form (Hermes, Qwen3) is the one read",
    )
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", choices=["auto", "cpu", "cuda"])
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument(
        "--speculative-config",
        type=speculative_config,
        metavar="JSON",
        help='vLLM\'s JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4}\' (methods: ngram, suffix, eagle with "model": a head '
        "folder from `molora train draft`; engine.speculative)",
    )
    p.add_argument("--host", help="HTTP bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="the API's HTTP port (default 8000)")
    p.add_argument(
        "--no-direct-ingress",
        dest="direct_ingress",
        action="store_false",
        help="serve through Ray Serve's HTTP proxy on --port instead of the router's own server "
        "(one more process hop per token; see docs/token_path.md)",
    )
    p.add_argument(
        "--address",
        help="a running Ray cluster to serve on (default: RAY_ADDRESS, else a new local "
        "cluster on 127.0.0.1, never the address file an earlier cluster left behind)",
    )
    p.add_argument("--num-replicas", type=int, help="model replicas")
    p.add_argument("--num-cpus", type=float, help="CPUs per model replica (its torch threads)")
    p.add_argument("--num-gpus", type=float, help="GPUs per model replica")
    p.add_argument("--store", help="adapter store: a directory or s3://bucket/prefix")
    p.add_argument("--store-endpoint-url", help="S3-compatible endpoint of --store")
    p.add_argument(
        "--dynamic-lora-loading-path",
        metavar="DIR_OR_S3",
        help="serve a folder or s3 prefix of PEFT folders (NAME/adapter_config.json + "
        "adapter_model.safetensors) read-only, as Ray Serve LLM's lora_config does",
    )
    p.add_argument("--lora-load-dir", help="folder /v1/load_lora_adapter may load paths from")
    p.add_argument(
        "--print-config", action="store_true", help="write the Serve YAML to stdout and exit"
    )
    for flag in UNSUPPORTED_VLLM_FLAGS:
        p.add_argument(flag, action=Unsupported, help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def rank_pools(value: str) -> list[dict[str, int]]:
    """`8:8,64:2` as hot_set.rank_pools entries (ranges are checked by the config)."""
    pools = []
    for part in value.split(","):
        rank, sep, slots = part.strip().partition(":")
        if not sep or not rank.isdigit() or not slots.isdigit():
            raise argparse.ArgumentTypeError(f"expected RANK:SLOTS[,RANK:SLOTS...], got {value!r}")
        pools.append({"rank": int(rank), "slots": int(slots)})
    return pools


def speculative_config(value: str) -> dict[str, Any]:
    """vLLM's `--speculative-config` JSON object (its fields are checked by the config)."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--speculative-config is not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError("--speculative-config must be a JSON object")
    return parsed


def default_store_dir() -> Path:
    """Where adapters published by `molora serve` live: the user's data directory, never the
    checkout."""
    return user_store_dir()


def build_document(args: argparse.Namespace) -> dict[str, Any]:
    """The shipped Serve document with the flags applied, its `args` validated."""
    doc = yaml.safe_load(TEMPLATE.read_text())
    app = doc["applications"][0]
    cfg = app["args"]
    engine = cfg["engine"]
    engine["model"] = args.model
    for flag, key in (
        ("dtype", "dtype"),
        ("device", "device"),
        ("max_num_seqs", "max_num_seqs"),
        ("max_model_len", "max_model_len"),
        ("max_num_batched_tokens", "max_num_batched_tokens"),
    ):
        if getattr(args, flag) is not None:
            engine[key] = getattr(args, flag)
    if args.lora_rank_pools:  # num_slots and max_rank follow from the pools
        engine["hot_set"]["rank_pools"] = args.lora_rank_pools
        engine["hot_set"].pop("num_slots", None)
        engine["hot_set"].pop("max_rank", None)
    if args.max_loras is not None:
        engine["hot_set"]["num_slots"] = args.max_loras
    if args.max_lora_rank is not None:
        engine["hot_set"]["max_rank"] = args.max_lora_rank
    if args.speculative_config is not None:
        engine["speculative"] = args.speculative_config
    if args.served_model_name:
        cfg["served_model_name"] = args.served_model_name
    if args.chat_template:
        engine["chat_template"] = chat_template_arg(args.chat_template)
    own_model = args.model != DEFAULT_MODEL_ALIAS
    if args.store or own_model or args.lora_modules:
        cfg["store"] = {"url": args.store or str(default_store_dir())}
        if args.store_endpoint_url:
            cfg["store"]["endpoint_url"] = args.store_endpoint_url
    if args.dynamic_lora_loading_path:
        where = args.dynamic_lora_loading_path
        if "://" not in where:
            where = str(Path(where).expanduser().resolve())
        cfg["store"]["layers"] = [f"{PEFT_PREFIX}{where}"]
        if args.store_endpoint_url:
            cfg["store"]["endpoint_url"] = args.store_endpoint_url
    if own_model:
        # The bundled routes name the embedded model's adapters.
        cfg["expose"]["routes"] = {}
    if args.lora_load_dir:
        cfg["server"]["runtime_lora"] = {"load_dir": str(Path(args.lora_load_dir).resolve())}
    if args.host:
        doc["http_options"]["host"] = args.host
    port = ROUTER_PORT if args.port is None else args.port
    # Direct ingress: the router serves `port` itself (the cluster's environment says so, see
    # cluster_env) and Serve's proxy the next port; without it the proxy serves `port`.
    doc["http_options"]["port"] = port + 1 if args.direct_ingress else port
    app.setdefault("runtime_env", {}).setdefault("env_vars", {})[ENABLE] = (
        "1" if args.direct_ingress else "0"
    )
    replica = next(d for d in app["deployments"] if d["name"] == "ModelReplica")
    if args.num_replicas is not None:
        replica["num_replicas"] = args.num_replicas
    options = replica.setdefault("ray_actor_options", {})
    if args.num_cpus is not None:
        options["num_cpus"] = args.num_cpus
    if args.num_gpus is not None:
        options["num_gpus"] = args.num_gpus
    served = ServeConfig.from_args(cfg)
    # The replica takes one call per sequence plus the router's stream channel.
    replica["max_ongoing_requests"] = served.engine.max_num_seqs + 1
    return doc


def cluster_env(args: argparse.Namespace) -> dict[str, str]:
    """What the cluster `serve run` starts must inherit: the proxy's stream guard (it wraps the
    router's own server too) and direct ingress on the API's port, or off."""
    port = ROUTER_PORT if args.port is None else args.port
    return {**PROXY_ENV_VARS, **direct_ingress_env(port, enabled=args.direct_ingress)}


def serve_run_env(
    args: argparse.Namespace, environ: Mapping[str, str] = os.environ
) -> tuple[dict[str, str], str]:
    """The environment of the `serve run` started, and the line saying which cluster it uses."""
    address, line = ray_address_env(environ, args.address)
    env = dict(environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_worker_niceness="0")
    return {**env, **cluster_env(args), **address}, line


def chat_template_arg(value: str) -> str:
    """The `--chat-template` value as the replicas will read it (a file by its absolute path)."""
    path = Path(value).expanduser()
    if value not in SHIPPED_TEMPLATES and path.is_file():
        value = str(path.resolve())
    try:
        read_chat_template(value)
    except (ChatTemplateError, OSError) as exc:
        raise ConfigError(f"--chat-template: {exc}") from None
    return value


def publish_modules(doc: dict[str, Any], modules: dict[str, str]) -> list[str]:
    """Publish each local PEFT folder under its name, a new version only when its files differ
    from the name's latest; returns the `name@version` refs served."""
    cfg = ServeConfig.from_args(doc["applications"][0]["args"])
    base_config = load_base_config(resolve_model_path(cfg.engine.model))
    top, _ = cfg.store.layer_urls()
    if top is not None and "://" not in top:
        Path(top).mkdir(parents=True, exist_ok=True, mode=0o700)
    registry = open_registry(cfg.store.resolved_url(), cfg.store.endpoint_url, create=True)
    refs = []
    for name, path in modules.items():
        folder = Path(path).expanduser()
        if not folder.is_dir():
            raise ConfigError(f"--lora-modules {name}: {path} is not a folder")
        try:
            versions = {v.version for v in registry.versions("adapter", name)}
            latest = registry.latest("adapter", name)
        except NotFoundError:
            latest = None
            versions = set()
        if latest is not None and all(
            (folder / e.path).is_file() and sha256_file(folder / e.path) == e.sha256
            for e in latest.files
        ):
            refs.append(latest.ref)
            continue
        version = next(f"v{n}" for n in range(1, len(versions) + 2) if f"v{n}" not in versions)
        try:
            manifest = registry.publish_adapter(folder, name, version, base_config=base_config)
        except InvalidInputError as exc:
            raise ConfigError(f"--lora-modules {name}: {exc}") from None
        refs.append(manifest.ref)
    return refs


class Unsupported(argparse.Action):
    """A vLLM flag with no meaning here: refused with the reason."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # type: ignore[override]
        parser.error(f"{option_string} is not supported: {UNSUPPORTED_VLLM_FLAGS[option_string]}")


def run(args: argparse.Namespace) -> int:
    if args.model not in GGUF_MODELS and not Path(args.model).expanduser().is_dir():
        sys.exit(f"molora serve: {args.model!r} is neither a prepared alias nor a model folder")
    try:
        doc = build_document(args)
        text = yaml.safe_dump(doc, sort_keys=False)
        if args.print_config:
            env = " ".join(f"{k}={v}" for k, v in cluster_env(args).items())
            sys.stdout.write(f"# start the cluster with this environment: {env}\n{text}")
            return 0
        for ref in publish_modules(doc, args.lora_modules):
            print(f"serving LoRA module {ref}", file=sys.stderr)
    except ConfigError as exc:
        sys.exit(f"molora serve: {exc}")
    handle, path = tempfile.mkstemp(prefix="molora-serve-", suffix=".yaml")
    with os.fdopen(handle, "w") as f:
        f.write(text)
    serve = Path(sys.executable).with_name("serve")
    env, line = serve_run_env(args)
    print(f"molora serve: {line}", file=sys.stderr, flush=True)
    os.execve(serve, [str(serve), "run", path], env)
    return 0  # not reached


def main(argv: list[str] | None = None) -> int:
    """Entry for `python -m deployments.ops.serve_cli`."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="molora")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *argv])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
