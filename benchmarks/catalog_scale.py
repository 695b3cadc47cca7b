"""What a store's size costs a router: its first catalog load and each background reload, over
stores of N adapters (a `peft:` folder of PEFT folders, local or on S3; a registry, local or on
S3; S3 is SeaweedFS on loopback).

A router loads the catalog once before its first answer, then re-lists the store in the
background every `store.refresh_s`; a request never waits on either, but both take CPU from
the box the router shares. Adapters are tiny (2 layers, 64x64, rank 4): the cost measured is
the listing's, not the bytes'. Prints a table and writes benchmarks/results/catalog_scale.json.

    python -m benchmarks.catalog_scale --n 1000 10000
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from adapter_store import open_backend, open_registry
from benchmarks.report import RESULTS_DIR, write_json
from deployments.catalog.store import CatalogLoader
from deployments.config import StoreConfig
from tests.support.seaweedfs import SeaweedFS

RESULTS = RESULTS_DIR / "catalog_scale.json"
BASE = "tiny-base"
RELOADS = 3


def tiny_adapter(folder: Path, seed: int) -> Path:
    """A valid PEFT LoRA folder of a few KB (q_proj of 2 layers, 64x64, rank 4)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for i in range(2):
        prefix = f"base_model.model.model.layers.{i}.self_attn.q_proj"
        tensors[f"{prefix}.lora_A.weight"] = rng.standard_normal((4, 64), dtype=np.float32)
        tensors[f"{prefix}.lora_B.weight"] = rng.standard_normal((64, 4), dtype=np.float32)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["q_proj"],
        "base_model_name_or_path": BASE,
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def make_stores(work: Path, n: int, seaweed: SeaweedFS | None) -> dict[str, StoreConfig]:
    """The same n adapters as a `peft:` folder, a local registry and (with SeaweedFS) an S3
    registry; made once per n under `work`."""
    folders = work / f"peft-{n}"
    if not (folders / f"a{n - 1:05d}").is_dir():
        for i in range(n):
            tiny_adapter(folders / f"a{i:05d}", i)
    local = work / f"registry-{n}"
    stores = {"peft folder": StoreConfig(url=f"peft:{folders}")}
    targets = [("local registry", str(local), None)]
    if seaweed is not None:
        bucket = seaweed.create_bucket()
        targets.append(("S3 registry", f"s3://{bucket}/store", seaweed.endpoint_url))
        prefix = open_backend(f"s3://{bucket}/peft", seaweed.endpoint_url)
        files = [(f"{p.parent.name}/{p.name}", p) for p in sorted(folders.glob("*/*"))]
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda kp: prefix.upload_file(*kp), files))
        stores["peft folder on S3"] = StoreConfig(
            url=f"peft:s3://{bucket}/peft", endpoint_url=seaweed.endpoint_url
        )
    for kind, url, endpoint in targets:
        registry = open_registry(url, endpoint, create=True)
        if not registry.names("adapter"):
            names = [f"a{i:05d}" for i in range(n)]
            with ThreadPoolExecutor(16) as pool:
                list(pool.map(registry.publish_adapter, [folders / m for m in names], names,
                              ["v1"] * n))  # fmt: skip
        stores[kind] = StoreConfig(url=url, endpoint_url=endpoint)
    return stores


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(cfg: StoreConfig, n: int) -> dict[str, Any]:
    """A router's loader: the first load, then RELOADS background reloads (wall and CPU s)."""
    loader = CatalogLoader(cfg)
    runs = []
    for _ in range(1 + RELOADS):
        wall, cpu = time.monotonic(), _cpu_s()
        catalog = loader()
        runs.append((time.monotonic() - wall, _cpu_s() - cpu))
        if len(catalog.adapters) != n:
            raise RuntimeError(f"{cfg.url}: {len(catalog.adapters)} adapters listed, not {n}")
    reload_wall = statistics.median(w for w, _ in runs[1:])
    reload_cpu = statistics.median(c for _, c in runs[1:])
    return {
        "first_load_s": round(runs[0][0], 3),
        "first_load_cpu_s": round(runs[0][1], 3),
        "reload_s": round(reload_wall, 3),
        "reload_cpu_s": round(reload_cpu, 3),
        # The share of a core a reload every refresh_s (10 s) would take.
        "reload_cpu_share_at_10s": round(reload_cpu / 10.0, 4),
    }


def git_commit() -> str:
    out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    dirty = subprocess.run(["git", "diff", "--quiet"], check=False).returncode != 0
    return out.stdout.strip() + ("-dirty" if dirty else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", nargs="+", type=int, default=[1000, 10000])
    ap.add_argument("--no-s3", action="store_true", help="skip the SeaweedFS store")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "molora-catalog")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    seaweed = None if args.no_s3 else SeaweedFS(args.work / f"seaweedfs-{os.getpid()}").start()
    if seaweed is not None:
        os.environ.update(seaweed.env())
    cells = []
    try:
        for n in args.n:
            for kind, cfg in make_stores(args.work, n, seaweed).items():
                cell = {"store": kind, "n": n, **measure(cfg, n)}
                print(json.dumps(cell), flush=True)
                cells.append(cell)
    finally:
        if seaweed is not None:
            seaweed.stop()
    head = "| store | N | first load s (CPU s) | reload s (CPU s) | a core at refresh_s 10 |"
    table = [head, "|---|---|---|---|---|"] + [
        f"| {c['store']} | {c['n']:,} | {c['first_load_s']} ({c['first_load_cpu_s']}) | "
        f"{c['reload_s']} ({c['reload_cpu_s']}) | {c['reload_cpu_share_at_10s']:.1%} |"
        for c in cells
    ]
    print("\n".join(table))
    write_json(
        args.out,
        {
            "benchmark": "catalog_scale",
            "git_commit": git_commit(),
            "args": {"n": args.n, "s3": seaweed is not None, "reloads": RELOADS},
            "cells": cells,
            "table": table,
        },
    )


if __name__ == "__main__":
    main()
