"""Cold path store → cache → hot-set slot for a SmolLM2-135M LoRA (r=16, all 7 targets), and
pull throughput against a plain boto3 `download_file` of the same objects.

Starts its own SeaweedFS (weed mini) on 127.0.0.1, prints a table, writes
benchmarks/results/store_pull.json. Usage: python benchmarks/store_pull.py [--reps 7]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

# Run as a script, this folder is sys.path[0] and its kernels.py would shadow the kernels package.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).parent.resolve():
    sys.path.pop(0)

from boto3.s3.transfer import TransferConfig
from safetensors.torch import load_file

from adapter_store import AdapterStoreSource, LocalCache, Registry
from adapter_store.backends.s3 import S3Backend
from adapter_store.layout import blob_key
from benchmarks.report import RESULTS_DIR, write_json
from molora_runtime.config import HotSetConfig
from molora_runtime.lora.hotset import HotSet
from molora_runtime.model.loader import load_model
from molora_runtime.model.model_paths import prepared_model_dir
from tests.support.seaweedfs import SeaweedFS

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MB = 1024 * 1024


def model_dir() -> Path:
    return prepared_model_dir("smollm2-135m-instruct")


def make_adapter(out: Path) -> Path:
    from peft import LoraConfig, get_peft_model  # the optional `train` extra

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir()), dtype=torch.float32)
    cfg = LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, init_lora_weights=False)
    get_peft_model(model, cfg).save_pretrained(str(out))
    return out


def hotset_factory() -> Callable[[AdapterStoreSource], HotSet]:
    """A builder of real HotSets on the 135M model (empty slots: every load is real)."""
    model = load_model(model_dir())
    config = HotSetConfig(num_slots=2, max_rank=16, target_modules=TARGETS, host_bytes=0)
    return lambda source: HotSet(
        model, config, source, torch.device("cpu"), torch.float32, max_num_seqs=1
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "store_pull.json")
    args = parser.parse_args()

    with (
        tempfile.TemporaryDirectory(prefix="molora-bench-") as tmp_s,
        SeaweedFS(Path(tmp_s) / "weed") as server,
    ):
        tmp = Path(tmp_s)
        os.environ.update(server.env())
        bucket = server.create_bucket()
        registry = Registry(S3Backend(bucket, "bench"))
        adapter = make_adapter(tmp / "adapter")
        t0 = time.perf_counter()
        manifest = registry.publish_adapter(
            adapter,
            "smol-r16",
            "1",
            base_config=json.loads((model_dir() / "config.json").read_text()),
        )
        publish_s = time.perf_counter() - t0
        size = manifest.total_size
        transfer = TransferConfig(
            multipart_threshold=8 * MB, multipart_chunksize=8 * MB, max_concurrency=10
        )
        plain = server.client()

        stages: dict[str, list[float]] = {k: [] for k in ("resolve", "pull", "parse", "slot")}
        make_hotset = hotset_factory()
        for rep in range(args.reps):
            # Cold path: fresh registry (new client, no manifest memo) and an empty cache.
            source = AdapterStoreSource(
                registry=Registry(S3Backend(bucket, "bench")),
                cache_dir=tmp / f"cold-{rep}",
                cache_bytes=1 << 30,
            )
            t0 = time.perf_counter()
            m = source.latest("adapter", "smol-r16")
            t1 = time.perf_counter()
            folder = source.cache.pull(source.registry, m)
            t2 = time.perf_counter()
            load_file(str(folder / "adapter_model.safetensors"))
            t3 = time.perf_counter()
            stages["resolve"].append(t1 - t0)
            stages["pull"].append(t2 - t1)
            stages["parse"].append(t3 - t2)
            hotset = make_hotset(source)  # empty slots: a real load on every rep
            t4 = time.perf_counter()
            hotset.ensure(["smol-r16@1"])  # adapter_path (cache hit) + parse + copy to slot
            stages["slot"].append(time.perf_counter() - t4)

        # Throughput, warm clients on both sides, interleaved to share the machine's noise.
        warm = Registry(S3Backend(bucket, "bench"))
        pull_s, plain_s = [], []
        for rep in range(args.reps * 3):
            dest = tmp / f"plain-{rep}"
            dest.mkdir()
            cache = LocalCache(tmp / f"warm-{rep}", 1 << 30)

            def run_plain(dest: Path = dest) -> None:
                for f in manifest.files:
                    key = "bench/" + blob_key(manifest, f.path)
                    plain.download_file(bucket, key, str(dest / f.path), Config=transfer)

            def run_store(cache: LocalCache = cache) -> None:
                cache.pull(warm, manifest)

            order = [(run_plain, plain_s), (run_store, pull_s)]
            for fn, times in order if rep % 2 == 0 else order[::-1]:  # alternate who goes first
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)

    med = {k: statistics.median(v) for k, v in stages.items() if v}
    pull_med, plain_med = statistics.median(pull_s), statistics.median(plain_s)
    result = {
        "adapter": {"base": "smollm2-135m-instruct", "rank": 16, "targets": TARGETS, "bytes": size},
        "reps": args.reps,
        "publish_s": publish_s,
        "cold_path_median_s": med,
        "cold_path_total_s": sum(med.values()),
        "hot_set_stage": "molora_runtime HotSet.ensure (parse + copy into slot, CPU)"
        if stages["slot"]
        else "not available",
        "store_pull_MBps": size / MB / pull_med,
        "plain_boto3_download_file_MBps": size / MB / plain_med,
        "ratio_vs_plain": plain_med / pull_med,
        "pull_s": pull_s,
        "plain_s": plain_s,
        "machine": {
            "server": "SeaweedFS weed mini on 127.0.0.1",
        },
    }
    write_json(args.out, result)
    print(
        f"adapter: SmolLM2-135M LoRA r=16, 7 targets, {size / MB:.1f} MiB; publish {publish_s:.2f}s"
    )
    print(f"{'stage':<34}{'median ms':>10}")
    labels = {
        "resolve": "resolve latest (list + manifest)",
        "pull": "store → cache (download+sha256)",
        "parse": "parse (safetensors load)",
        "slot": "cache → hot-set slot",
    }
    for key, value in med.items():
        print(f"{labels[key]:<34}{value * 1000:>10.1f}")
    print(f"{'cold path total':<34}{result['cold_path_total_s'] * 1000:>10.1f}")
    print(
        f"pull {result['store_pull_MBps']:.0f} MiB/s vs plain boto3 {result['plain_boto3_download_file_MBps']:.0f} MiB/s → {result['ratio_vs_plain']:.2f}x"
    )


if __name__ == "__main__":
    main()
