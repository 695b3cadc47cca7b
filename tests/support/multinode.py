"""A multi-node Ray cluster on loopback (a head and worker nodes, each its own raylet, object store
and workers) serving the app from the `serve_config` format, for cluster tests and benchmarks.

Nodes come from `ray.cluster_utils.Cluster`, Ray's own multi-node test harness. The head holds the
Serve controller, the HTTP proxy and the routers (custom resource `head`); each worker node holds
`model_slot` resources for the model replicas plus a resource naming it (`node_a`, `node_b`), and
its own `MOLORA_HOME`, so every node has its own adapter disk cache in front of the shared
SeaweedFS S3 store. Ray token auth stays on (the random token of this process's environment).
Every node, the driver and every client use 127.0.0.1 (`local_ray.pin_loopback`), checked at
start (`local_ray.loopback_faults`).
A worker node can be killed abruptly (raylet and its workers, SIGKILL) and re-added.

Apps are deployed as `serve deploy` does: a `ServeDeploySchema` handed to the Serve controller,
built from the shipped serve_config.yaml with the tiny model and the S3 store swapped in.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from deployments.replica.serve_env import PROXY_ENV_VARS
from tests.support import ports
from tests.support.local_ray import HARNESS_ENV_VARS, LOOPBACK, loopback_faults, pin_loopback
from tests.support.seaweedfs import SeaweedFS

ROOT = Path(__file__).resolve().parents[2]
APP = "molora"
WORKERS = ("node_a", "node_b")
# Fast node-death detection: a killed raylet is declared dead in ~3 s, not Ray's default ~30 s.
FAST_FAILURE = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
}


def ensure_token_auth() -> None:
    """Ray token auth on, with a per-process random token (set before Ray reads its config)."""
    os.environ["RAY_AUTH_MODE"] = "token"
    if not (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")):
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    with contextlib.suppress(ImportError, AttributeError):
        from ray._raylet import Config

        Config.initialize("")


def make_assets(work: Path, n_adapters: int) -> tuple[Path, Path]:
    """A tiny Llama (SmolLM2's tokenizer) and `n_adapters` PEFT folders `a00`.. with seeded weights."""
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file
    from transformers import LlamaForCausalLM

    from molora_runtime.model.tiny import make_tiny_model

    model = make_tiny_model(work / "model", with_tokenizer=True, tie_word_embeddings=True)
    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    template = work / "adapters" / "template"
    get_peft_model(LlamaForCausalLM.from_pretrained(model), lora).save_pretrained(template)
    weights = load_file(str(template / "adapter_model.safetensors"))
    for i in range(n_adapters):
        gen = torch.Generator().manual_seed(i + 1)
        folder = work / "adapters" / f"a{i:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(template / "adapter_config.json", folder)
        tensors = {k: torch.randn(v.shape, generator=gen) * 0.05 for k, v in weights.items()}
        save_file(tensors, str(folder / "adapter_model.safetensors"))
    shutil.rmtree(template)
    return model, work / "adapters"


def app_config(
    model: Path,
    store: dict[str, str],
    *,
    model_replicas: int = 4,
    slots: int = 4,
    max_num_seqs: int = 8,
    policy: str = "affinity",
    autoscaling: dict[str, Any] | None = None,
    max_per_node: int | None = None,
) -> dict[str, Any]:
    """The shipped serve_config.yaml's application, on the tiny model and the S3 store: model
    replicas on worker nodes' `model_slot`s (fractional CPUs), two routers on the head."""
    shipped = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    app = copy.deepcopy(shipped["applications"][0])
    # Served through Serve's proxy alone (HARNESS_ENV_VARS): two routers share the head, so the
    # one-router-per-node rule of direct ingress's fixed port is lifted too.
    app["runtime_env"]["env_vars"].update(HARNESS_ENV_VARS)
    args = app["args"]
    args["engine"].update(
        model=str(model), dtype="float32", max_num_seqs=max_num_seqs, max_model_len=512
    )
    args["engine"]["hot_set"].update(num_slots=slots, max_rank=4)
    args["store"] = {**store, "refresh_s": 2}
    args["placement"].update(policy=policy, stats_period_s=0.5)
    args["served_model_name"] = "tiny-base"
    args["expose"].pop("routes", None)  # the shipped routes name default-store adapters
    args["server"]["default_max_tokens"] = 32
    for d in app["deployments"]:
        if d["name"] == "ModelReplica":
            d.update(
                max_ongoing_requests=max_num_seqs + 1,
                graceful_shutdown_wait_loop_s=0.5,
                graceful_shutdown_timeout_s=20,
                health_check_period_s=2,
                health_check_timeout_s=10,
                ray_actor_options={"num_cpus": 0.25, "resources": {"model_slot": 1}},
            )
            if max_per_node:
                d["max_replicas_per_node"] = max_per_node
            if autoscaling:
                d.pop("num_replicas", None)
                d["autoscaling_config"] = autoscaling
            else:
                d["num_replicas"] = model_replicas
        else:
            d.pop("max_replicas_per_node", None)
            d.update(num_replicas=2, ray_actor_options={"num_cpus": 0, "resources": {"head": 0.01}})
    return app


class RedisServer:
    """A loopback `redis-server` (Debian's package) with a password, holding Ray's GCS state
    (GCS fault tolerance, as KubeRay's gcsFaultToleranceOptions sets it up)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.password = secrets.token_hex(16)
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @staticmethod
    def available() -> bool:
        return shutil.which("redis-server") is not None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> RedisServer:
        import socket

        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = ports.free_port()
        # The password goes in a private config file, not on a command line others can list.
        conf = self.workdir / "redis.conf"
        conf.touch(mode=0o600)
        conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\nrequirepass {self.password}\n"
            f'save ""\nappendonly no\ndir {self.workdir}\n'
        )
        log = (self.workdir / "redis.log").open("wb")
        self.proc = subprocess.Popen(
            ["redis-server", str(conf)], stdout=log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited; see {self.workdir / 'redis.log'}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), 1),
            ):
                return self
            time.sleep(0.1)
        raise TimeoutError("redis-server did not listen")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


@dataclass
class MultiNodeCluster:
    """Head + worker nodes on 127.0.0.1, SeaweedFS, Serve's HTTP proxy on the head."""

    work: Path
    owns_work: bool = False
    worker_cpus: float = 1.0
    slots_per_node: int = 2
    gcs_ft: bool = False
    redis: RedisServer | None = None
    http_port: int = 0
    cluster: Any = None
    seaweed: SeaweedFS | None = None
    nodes: dict[str, Any] = field(default_factory=dict)
    gcs_address: str = ""
    # Ray's sockets live here: AF_UNIX paths are limited to 107 bytes, so a short temp dir.
    ray_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="mn-ray-"))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> MultiNodeCluster:
        pin_loopback()  # before any address is handed to Ray
        ensure_token_auth()
        self.seaweed = SeaweedFS(self.work / "seaweedfs").start()
        os.environ.update(self.seaweed.env())  # every node's workers inherit the S3 identity
        import ray
        from ray import serve
        from ray._private.utils import get_ray_address_file
        from ray.cluster_utils import Cluster

        # `Cluster` records its address in Ray's default temp dir whatever `temp_dir` says, and
        # fails where that dir does not exist yet (a fresh machine, before any Ray ran there)
        Path(get_ray_address_file(None)).parent.mkdir(parents=True, exist_ok=True)

        head_args: dict[str, Any] = {
            "num_cpus": 1,
            "resources": {"head": 1},
            "include_dashboard": False,
            "node_ip_address": LOOPBACK,
            "temp_dir": self.ray_dir,
            "_system_config": FAST_FAILURE,
            "env_vars": self._node_env("head"),
        }
        if self.gcs_ft:  # GCS fault tolerance: the GCS keeps its tables in Redis
            self.redis = RedisServer(self.work / "redis").start()
            head_args["external_addresses"] = [self.redis.address]
            head_args["redis_password"] = self.redis.password
            head_args["gcs_server_port"] = ports.free_port()  # a restarted GCS binds it again
        self.cluster = Cluster(initialize_head=True, head_node_args=head_args)
        self.nodes["head"] = self.cluster.head_node
        for name in WORKERS:
            self.add_worker(name)
        self.gcs_address = self.cluster.address
        ray.init(
            address=self.gcs_address,
            _node_ip_address=LOOPBACK,
            log_to_driver=False,
            configure_logging=False,
        )
        if faults := loopback_faults(self.gcs_address):
            raise RuntimeError(f"the cluster is not on {LOOPBACK}: {'; '.join(faults)}")
        self.http_port = ports.free_port()
        serve.start(
            proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": self.http_port}
        )
        return self

    def _node_env(self, name: str) -> dict[str, str]:
        home = self.work / f"home-{name}"
        home.mkdir(parents=True, exist_ok=True)
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        # The proxy's stream guard too, as every shipped launcher sets it (PROXY_ENV_VARS):
        # without it a request whose router dies before answering is Ray's plain-text 500.
        return {"MOLORA_HOME": str(home), "PYTHONPATH": path, **HARNESS_ENV_VARS, **PROXY_ENV_VARS}

    def add_worker(self, name: str) -> str:
        """Start (or re-add) the worker node `name`; returns its node id."""
        node = self.cluster.add_node(
            num_cpus=self.worker_cpus,
            resources={name: 1, "model_slot": self.slots_per_node},
            node_ip_address=LOOPBACK,
            env_vars=self._node_env(name),
        )
        self.nodes[name] = node
        return node.node_id

    def kill_worker(self, name: str) -> list[int]:
        """Kill the node's raylet and every worker it started, abruptly (SIGKILL)."""
        import psutil

        node = self.nodes.pop(name)
        raylet = node.all_processes["raylet"][0].process.pid
        children = psutil.Process(raylet).children(recursive=True)
        pids = [raylet, *(c.pid for c in children)]
        for pid in reversed(pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.cluster.remove_node(node, allow_graceful=False)
        return pids

    def kill_gcs(self) -> None:
        """Kill the head's GCS server (SIGKILL); raylets and workers keep running meanwhile."""
        self.nodes["head"].kill_gcs_server(check_alive=False)

    def restart_gcs(self) -> None:
        """Start the GCS again; with Redis it recovers the cluster's state from there."""
        self.nodes["head"].start_gcs_server()

    def node_ids(self) -> dict[str, str]:
        return {name: node.node_id for name, node in self.nodes.items()}

    def stop(self) -> None:
        import ray
        from ray import serve

        with contextlib.suppress(Exception):
            serve.shutdown()
        with contextlib.suppress(Exception):
            ray.shutdown()
        if self.cluster is not None:
            with contextlib.suppress(Exception):
                self.cluster.shutdown()
        if self.seaweed is not None:
            self.seaweed.stop()
        if self.redis is not None:
            self.redis.stop()
        shutil.rmtree(self.ray_dir, ignore_errors=True)
        if self.owns_work:
            shutil.rmtree(self.work, ignore_errors=True)

    # -- the app --------------------------------------------------------------------------

    def publish(self, adapters: Path, workers: int = 1) -> dict[str, str]:
        """Every adapter folder published to a fresh bucket as `<name>@v1` (`workers` at once);
        the store args."""
        from adapter_store import open_registry

        assert self.seaweed is not None
        bucket = self.seaweed.create_bucket()
        url = f"s3://{bucket}/adapters"
        registry = open_registry(url, self.seaweed.endpoint_url, create=True)
        folders = sorted(adapters.iterdir())
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda f: registry.publish_adapter(f, f.name, "v1"), folders))
        return {"url": url, "endpoint_url": self.seaweed.endpoint_url}

    def deploy(self, app: dict[str, Any], timeout_s: float = 240.0) -> None:
        """`serve deploy` of one application (the controller applies it, rolling as needed)."""
        from ray.serve.context import _get_global_client
        from ray.serve.schema import ServeDeploySchema

        config = {
            "proxy_location": "HeadOnly",
            "http_options": {"host": "127.0.0.1", "port": self.http_port},
            "applications": [app],
        }
        _get_global_client().deploy_apps(ServeDeploySchema.model_validate(config))
        self.wait_running(timeout_s)

    def wait_running(self, timeout_s: float = 240.0) -> None:
        from ray import serve

        deadline = time.monotonic() + timeout_s
        status = None
        while time.monotonic() < deadline:
            status = serve.status().applications.get(APP)
            if status is not None and str(getattr(status.status, "value", "")) == "RUNNING":
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{self.url}/health", timeout=10).status_code == 200:
                        return
            time.sleep(0.5)
        raise TimeoutError(f"app {APP} not running after {timeout_s}s: {status}")

    def replicas(self, deployment: str = "ModelReplica") -> list[dict[str, Any]]:
        """The deployment's replicas as the controller sees them: id, node id, state."""
        import ray
        from ray.serve.context import _get_global_client

        details = ray.get(_get_global_client()._controller.get_serve_instance_details.remote())
        app = details.get("applications", {}).get(APP) or {}
        found = app.get("deployments", {}).get(deployment, {}).get("replicas", [])
        return [
            {"replica_id": r["replica_id"], "node_id": r.get("node_id"), "state": r["state"]}
            for r in found
        ]

    def running_by_node(self, deployment: str = "ModelReplica") -> dict[str, int]:
        """Running replicas per node name (`?` for a node this harness does not know)."""
        names = {nid: name for name, nid in self.node_ids().items()}
        counts: dict[str, int] = {}
        for r in self.replicas(deployment):
            if r["state"] == "RUNNING":
                key = names.get(r["node_id"], "?")
                counts[key] = counts.get(key, 0) + 1
        return counts


def start_multinode(work: Path | None = None, **kwargs: Any) -> MultiNodeCluster:
    """Start the cluster (and SeaweedFS) in `work` (a fresh temp dir by default)."""
    owns = work is None
    work = work or Path(tempfile.mkdtemp(prefix="molora-mn-"))
    cluster = MultiNodeCluster(work=work, owns_work=owns, **kwargs)
    try:
        return cluster.start()
    except BaseException:
        cluster.stop()
        raise


def stream_events(lines: list[str]) -> list[dict[str, Any]]:
    """The JSON events of an SSE body's `data:` lines (the `[DONE]` marker left out)."""
    out = []
    for line in lines:
        if line.startswith("data: ") and line[6:] != "[DONE]":
            out.append(json.loads(line[6:]))
    return out
