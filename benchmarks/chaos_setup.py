"""The chaos benchmark's real parts: a tiny model, adapters of three ranks, compositions, API keys
for two tenants and an admin, SeaweedFS, a local multi-node Ray cluster on loopback (token auth
on, no dashboard; `tests.support.multinode`), and `serve run` of a generated config on it.

Everything here is started for real; nothing is mocked. `serve run` is a child process in a
session of its own (stopped with `benchmarks.server_process.stop`), pointed at the cluster with
RAY_ADDRESS, so the app is deployed exactly as an operator's `serve run CONFIG` would.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks.server_process import stop as stop_session
from deployments.access.auth import KeyFile, new_key, write_key_file
from tests.support.multinode import MultiNodeCluster, app_config, start_multinode

ROOT = Path(__file__).resolve().parents[1]
RANKS = (4, 8, 16)
TARGETS = ("q_proj", "v_proj")
# Holders of API keys: (holder, tenant, admin). `globex_flood` is globex's quota-limited key.
HOLDERS = [
    ("acme", "acme", False),
    ("globex", "globex", False),
    ("admin", "acme", True),
    ("globex_admin", "globex", True),
    ("globex_flood", "globex", False),
]
FLOOD_QUOTA = {"max_concurrent": 4, "requests_per_min": 600}
# Private adapters: names only their tenant may ever see in a response (the fuzz checks this).
PRIVATE = {"acme": "acme-secret-recipe", "globex": "globex-hidden-plan"}


@dataclass
class Assets:
    model: Path
    adapters: dict[str, Path]  # name -> PEFT folder (public, published as @v1)
    ranks: dict[str, int]
    load_dir: Path  # runtime-LoRA folders (`/v1/load_lora_adapter` paths)
    load_folders: list[str]  # folder names inside load_dir
    cold: str  # published, never requested before the store outage
    compositions: dict[str, tuple[str, str]]  # name -> its two experts


def _peft_template(model: Path, rank: int, out: Path) -> tuple[dict[str, Any], Path]:
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    torch.manual_seed(rank)
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(TARGETS))
    get_peft_model(LlamaForCausalLM.from_pretrained(model), lora).save_pretrained(out)
    return load_file(str(out / "adapter_model.safetensors")), out / "adapter_config.json"


def make_assets(work: Path, n_adapters: int, n_load: int, n_comps: int) -> Assets:
    """The tiny Llama (SmolLM2's tokenizer, 2 layers, 64 wide) and seeded random adapters:
    `n_adapters` public ones with ranks cycling over RANKS, `n_load` runtime-load folders, one
    cold adapter, and the private adapter of each tenant."""
    import torch
    from safetensors.torch import save_file

    from molora_runtime.model.tiny import make_tiny_model

    model = make_tiny_model(work / "model", with_tokenizer=True, tie_word_embeddings=True)
    templates = {r: _peft_template(model, r, work / f"template-r{r}") for r in RANKS}

    def one(folder: Path, rank: int, seed: int) -> Path:
        weights, config = templates[rank]
        gen = torch.Generator().manual_seed(seed)
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(config, folder)
        # B is zero in a fresh PEFT adapter: every tensor random, so each adapter changes logits
        tensors = {k: torch.randn(v.shape, generator=gen) * 0.08 for k, v in weights.items()}
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        return folder

    adapters, ranks = {}, {}
    for i in range(n_adapters):
        name = f"r{RANKS[i % 3]}-a{i:02d}"
        adapters[name] = one(work / "adapters" / name, RANKS[i % 3], 1000 + i)
        ranks[name] = RANKS[i % 3]
    cold = "cold-adapter"
    adapters[cold] = one(work / "adapters" / cold, 8, 7)
    ranks[cold] = 8
    load_dir = work / "loras"
    folders = []
    for i in range(n_load):
        rank = RANKS[i % 3]
        one(load_dir / f"w{i:02d}", rank, 5000 + i)
        folders.append(f"w{i:02d}")
    for r in RANKS:
        shutil.rmtree(work / f"template-r{r}")
    names = [n for n in adapters if n != cold]
    comps = {f"comp{c}": (names[2 * c], names[2 * c + 3]) for c in range(n_comps)}
    return Assets(model, adapters, ranks, load_dir, folders, cold, comps)


def publish_store(mn: MultiNodeCluster, assets: Assets, comp_versions: int) -> dict[str, str]:
    """A fresh bucket with every public adapter as @v1, each tenant's private adapter, and each
    composition at `comp_versions` versions (different gates; all but v1 yanked, to be
    unyanked by the churn: a composition re-weighted through the admin API)."""
    import torch

    from adapter_store import open_registry
    from molora_runtime.lora.composition import CompositionConfig, save_composition

    assert mn.seaweed is not None
    bucket = mn.seaweed.create_bucket()
    url = f"s3://{bucket}/adapters"
    registry = open_registry(url, mn.seaweed.endpoint_url, create=True)
    for name, folder in assets.adapters.items():
        registry.publish_adapter(folder, name, "v1")
    some = next(iter(assets.adapters.values()))
    for tenant, name in PRIVATE.items():
        registry.publish_adapter(some, name, "v1", tenant=tenant)
    base = registry.resolve("adapter", next(iter(assets.adapters))).base_model
    for cname, experts in assets.compositions.items():
        for v in range(1, comp_versions + 1):
            cfg = CompositionConfig(
                base_model=base, adapters=list(experts), top_k=1, num_layers=2, hidden_size=64
            )
            torch.manual_seed(hash((cname, v)) % 10_000)
            gates = torch.randn(2, 2, 64) * 3
            folder = save_composition(mn.work / "comps" / f"{cname}-v{v}", cfg, gates)
            registry.publish_composition(folder, cname, f"v{v}")
            if v > 1:
                registry.yank("composition", cname, f"v{v}", "staged: unyanked by the churn")
    return {"url": url, "endpoint_url": mn.seaweed.endpoint_url}


def write_keys(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """The key file; returns each holder's key and each holder's key id."""
    keys, ids, entries = {}, {}, []
    for holder, tenant, admin in HOLDERS:
        keys[holder], entry = new_key(tenant, admin=admin)
        ids[holder] = entry.key_id
        entries.append(entry)
    write_key_file(path, KeyFile(keys=entries))
    return keys, ids


def serve_document(
    mn: MultiNodeCluster,
    assets: Assets,
    store: dict[str, str],
    key_file: Path,
    key_ids: dict[str, str],
    max_num_seqs: int,
) -> dict[str, Any]:
    """The `serve run` config: the shipped application on the tiny model and SeaweedFS (2 model
    replicas, one per worker node, 2 routers on the head), auth on, runtime LoRA loads from
    `assets.load_dir`, globex's flood key under a quota."""
    app = app_config(
        assets.model, store, model_replicas=2, slots=8, max_num_seqs=max_num_seqs, max_per_node=1
    )
    args = app["args"]
    args["engine"]["hot_set"].update(max_rank=max(RANKS))
    args["engine"]["max_queue_len"] = 256
    args["store"]["cache_dir"] = str(mn.work / "store-cache")
    args["server"]["auth"] = {"enabled": True, "keys_file": str(key_file), "reload_s": 5}
    args["server"]["runtime_lora"] = {"load_dir": os.path.relpath(assets.load_dir, ROOT)}
    args["server"]["quotas"] = {"keys": {key_ids["globex_flood"]: FLOOD_QUOTA}}
    for d in app["deployments"]:
        if d["name"] == "ModelReplica":
            d["max_ongoing_requests"] = max_num_seqs + 1
            d["max_queued_requests"] = 256
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": mn.http_port, "request_timeout_s": 600},
        "logging_config": {"encoding": "TEXT", "log_level": "INFO", "enable_access_log": False},
        "applications": [app],
    }


@dataclass
class Bench:
    """The running parts, and where to reach them."""

    mn: MultiNodeCluster
    assets: Assets
    store: dict[str, str]
    keys: dict[str, str]
    serve_proc: subprocess.Popen | None = None
    serve_log: Path | None = None
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.mn.url

    def headers(self, holder: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[holder]}"}


def serve_run(
    mn: MultiNodeCluster, document: dict[str, Any], timeout_s: float = 300
) -> tuple[subprocess.Popen, Path]:
    """`serve run CONFIG` against the cluster (RAY_ADDRESS), in a session of its own; returns
    once the app answers /health through Serve's proxy."""
    config = mn.work / "chaos_serve.yaml"
    config.write_text(yaml.safe_dump(document, sort_keys=False))
    log = mn.work / "serve_run.log"
    env = {
        **os.environ,
        "RAY_ADDRESS": mn.gcs_address,
        "PYTHONPATH": str(ROOT),
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    }
    serve = Path(sys.executable).parent / "serve"
    proc = subprocess.Popen(
        [str(serve), "run", str(config)],
        env=env,
        cwd=ROOT,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve run exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{mn.url}/health", timeout=5).status_code == 200:
                return proc, log
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"serve run not healthy in {timeout_s} s:\n{log.read_text()[-3000:]}")


def start(
    work: Path,
    *,
    n_adapters: int,
    n_load: int,
    n_comps: int,
    comp_versions: int,
    max_num_seqs: int,
    gcs_ft: bool,
) -> Bench:
    assets = make_assets(work / "assets", n_adapters, n_load, n_comps)
    mn = start_multinode(work / "cluster", gcs_ft=gcs_ft)
    try:
        store = publish_store(mn, assets, comp_versions)
        keys, ids = write_keys(work / "keys.json")
        doc = serve_document(mn, assets, store, work / "keys.json", ids, max_num_seqs)
        bench = Bench(mn, assets, store, keys)
        bench.serve_proc, bench.serve_log = serve_run(mn, doc)
        return bench
    except BaseException:
        mn.stop()
        raise


def stop(bench: Bench) -> None:
    if bench.serve_proc is not None:
        stop_session(bench.serve_proc, grace_s=15, linger_s=10)
    bench.mn.stop()


# ---- the processes a fault hits ------------------------------------------------------------


def actor_pids(mn: MultiNodeCluster, deployment: str, app: str = "molora") -> list[int]:
    """Pids of the live replica processes of `deployment` in *this* cluster: descendants of its
    raylets whose environment carries this run's MOLORA_HOME (the box is shared, and other
    clusters on it serve apps of the same name: a fault must never reach their processes).
    Ray titles a replica `ray::ServeReplica:APP:DEPLOYMENT`."""
    import psutil

    want = f"ray::ServeReplica:{app}:{deployment}"
    home = str(mn.work / "home-")
    pids = []
    for node in mn.nodes.values():
        try:
            raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
            children = raylet.children(recursive=True)
        except (psutil.Error, KeyError, IndexError):
            continue
        for proc in children:
            try:
                if proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                if not " ".join(proc.cmdline()).startswith(want):
                    continue
                if not proc.environ().get("MOLORA_HOME", "").startswith(home):
                    continue
            except psutil.Error:
                continue
            pids.append(proc.pid)
    return sorted(set(pids))


def lscpu() -> dict[str, Any]:
    """The CPU's model name and flags as `lscpu` says them."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    fields = dict(re.findall(r"^([^:\n]+):\s*(.*)$", out, re.M))
    return {"model_name": fields.get("Model name"), "flags": fields.get("Flags", "").split()}


def git_commit() -> dict[str, Any]:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}


def dump(obj: Any) -> str:
    return json.dumps(obj, default=str)
