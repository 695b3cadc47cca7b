"""A failing store delays or fails only the requests that need the adapter it holds.

A real SeaweedFS (started here, on ports from `tests.support.ports`) stops while a cold adapter is
being fetched, or serves an object whose checksum no longer matches: the request for that
adapter ends with the store's error type, while streams on cached adapters keep decoding and
later requests pass the stalled one. No timings are asserted, only completions and order.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from adapter_store import AdapterStoreSource, IntegrityError, Registry, StoreUnavailableError
from adapter_store.backends.s3 import S3Backend
from adapter_store.layout import blob_key
from molora_runtime.engine.engine import LLMEngine
from molora_runtime.model.tiny import make_tiny_model
from tests.molora_runtime.rt_util import (
    engine_config,
    make_peft_adapter,
    random_prompts,
    request,
    run_beside_a_failed_load,
    run_to_completion,
)
from tests.support.seaweedfs import SeaweedFS

pytestmark = pytest.mark.slow  # starts a SeaweedFS of its own (`doomed`)

NAMES = ("a", "b", "cold")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fault-assets")
    model = make_tiny_model(root / "model", "llama", seed=0)
    folders = {
        name: make_peft_adapter(model, root / name, r=4, alpha=8, seed=i + 1)
        for i, name in enumerate(NAMES)
    }
    return {"model": model, **folders}


@pytest.fixture
def doomed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SeaweedFS]:
    """A private server this test stops (the session one stays up)."""
    server = SeaweedFS(tmp_path / "doomed").start()
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    yield server
    server.stop()


def _registry(server: SeaweedFS, bucket: str, prefix: str = "faults") -> Registry:
    backend = S3Backend(
        bucket, prefix, endpoint_url=server.endpoint_url, max_attempts=1,
        connect_timeout=1, read_timeout=3,
    )  # fmt: skip
    return Registry(backend)


def _engine(tiny: dict[str, Path], source: AdapterStoreSource) -> LLMEngine:
    config = engine_config(tiny["model"], max_num_seqs=4, hot_set={"num_slots": 4})
    return LLMEngine(config, source)


def _finals(got: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {rid: res["outputs"][-1] for rid, res in got.items()}


def test_store_stopped_mid_fetch_fails_only_its_requests(
    doomed: SeaweedFS, tiny: dict[str, Path], tmp_path: Path
) -> None:
    registry = _registry(doomed, doomed.create_bucket())
    for name in NAMES:
        registry.publish_adapter(tiny[name], name, "1")
    source = AdapterStoreSource(registry=registry, cache_dir=tmp_path / "cache")
    for ref in ("a@1", "b@1"):
        source.adapter_path(ref)  # cached before the outage
    # The cold adapter's download starts, then waits until the server is gone.
    release, waiting = threading.Event(), threading.Event()
    fetch_to = registry.fetch_to

    def stalled_fetch(manifest, entry, path, progress=None):  # type: ignore[no-untyped-def]
        if manifest.name == "cold":
            waiting.set()
            release.wait(600)
        return fetch_to(manifest, entry, path, progress)

    registry.fetch_to = stalled_fetch  # type: ignore[method-assign]
    engine = _engine(tiny, source)
    prompts = random_prompts(3, 256, [6, 7, 5], seed=11)
    running_tokens: list[int] = []
    passed_while_stalled: list[bool] = []

    def watch(step: int, eng: LLMEngine) -> None:
        if release.is_set() or not waiting.is_set():
            return
        live = {s.request_id: s for s in [*eng.running, *eng.waiting]}
        if "r" in live:
            running_tokens.append(len(live["r"].output_ids))
        if "y" not in live and "x" in live and len(running_tokens) >= 3:
            passed_while_stalled.append(True)  # y finished while x's fetch hung
            doomed.kill()
            release.set()

    got = run_beside_a_failed_load(
        engine, prompts, ("a@1", "cold@1", "b@1"), long=80, after_step=watch
    )
    assert passed_while_stalled == [True]
    assert len(set(running_tokens)) > 2  # the running stream decoded through the stall
    assert isinstance(_finals(got)["x"].exception, StoreUnavailableError)
    # With the store gone for good, cached adapters still serve and the cold one still fails
    # (its manifest is remembered, so it is admitted and its fetch fails in the background).
    later = _finals(
        run_to_completion(
            engine,
            [request("r2", prompts[0], "a@1", 30)],
            schedule={
                1: [request("x2", prompts[1], "cold@1", 2), request("z", prompts[2], "b@1", 3)]
            },
        )
    )
    assert later["r2"].finish_reason == "length" and later["z"].finish_reason == "length"
    assert isinstance(later["x2"].exception, StoreUnavailableError)
    assert source.disk_tier()["adapters"] == ["a", "b"]
    engine.hot_set.host.shutdown()


def test_corrupted_object_fails_only_its_requests(
    seaweed: SeaweedFS, s3_bucket: str, tiny: dict[str, Path], tmp_path: Path
) -> None:
    registry = _registry(seaweed, s3_bucket, prefix=f"corrupt-{tmp_path.name}")
    for name in ("a", "b"):
        registry.publish_adapter(tiny[name], name, "1")
    bad = registry.publish_adapter(tiny["cold"], "bad", "1")
    key = blob_key(bad, "adapter_model.safetensors")
    data = bytearray(registry.backend.read_bytes(key))
    data[len(data) // 2] ^= 0xFF
    registry.backend.put_bytes(key, bytes(data))
    source = AdapterStoreSource(registry=registry, cache_dir=tmp_path / "cache")
    engine = _engine(tiny, source)
    prompts = random_prompts(3, 256, [6, 7, 5], seed=12)
    got = run_beside_a_failed_load(engine, prompts, ("a@1", "bad@1", "b@1"), long=40)
    assert isinstance(_finals(got)["x"].exception, IntegrityError)
    assert "verification" in got["x"]["error"]
    assert "bad" not in source.disk_tier()["adapters"]  # nothing unverified reached the cache
    again = _finals(run_to_completion(engine, [request("x2", prompts[1], "bad@1", 2)]))
    assert isinstance(again["x2"].exception, IntegrityError)
    engine.hot_set.host.shutdown()
