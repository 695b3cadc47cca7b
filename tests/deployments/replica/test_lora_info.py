"""What a replica exports about its adapters (deployments/replica/lora_info.py, replica_metrics):
vLLM's `lora_requests_info` labels and the slot/host residency rows, bounded and without a
tenant's adapter names. No Ray: the metric objects are replaced by recorders."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from deployments.replica.lora_info import (
    MAX_LISTED,
    OTHER,
    ResidencyRow,
    adapter_list,
    lora_info_tags,
    public_name,
    residency_rows,
)
from deployments.replica.replica_metrics import ReplicaMetrics
from deployments.telemetry import metric_names, metrics
from molora_runtime.engine.types import EngineStats, RequestAdapters


def test_public_name_drops_version_and_hides_namespaces() -> None:
    assert public_name("math@v3") == "math"
    assert public_name("math") == "math"
    assert public_name("acme~secret@v1") == "private"
    assert public_name("acme~secret") == "private"


def test_list_is_most_requested_first_without_spaces() -> None:
    counts = {"b@1": 1, "a@2": 1, "c@1": 5, "acme~x@1": 2, "evil~y@1": 1}
    assert adapter_list(counts) == "c,private,a,b"  # privates merged: 3 requests
    assert adapter_list({}) == ""
    # two versions of one name are one name
    assert adapter_list({"a@1": 1, "a@2": 1}) == "a"


def test_list_is_capped_with_a_count_of_the_rest() -> None:
    counts = {f"ad{i:05d}@v1": 100 - i for i in range(40)}
    got = adapter_list(counts).split(",")
    assert len(got) == MAX_LISTED + 1
    assert got[:3] == ["ad00000", "ad00001", "ad00002"]
    assert got[-1] == f"+{40 - MAX_LISTED}"
    assert adapter_list(counts, cap=40) == ",".join(f"ad{i:05d}" for i in range(40))


def test_lora_info_tags_are_vllms_labels() -> None:
    tags = lora_info_tags({"a@1": 2}, {"b@1": 1, "acme~c@1": 1}, num_slots=8)
    assert tags == {
        "max_lora": "8",
        "running_lora_adapters": "a",
        "waiting_lora_adapters": "b,private",
    }
    assert set(tags) == set(metrics.SPECS[metric_names.VLLM_LORA_INFO].tags)


def test_residency_rows_slot_and_host_private_and_capped() -> None:
    slots = ["a@1", "acme~s@1", "evil~t@2", "p@1"]
    host = ["a@1", "h1@1", "h2@1", "h3@1", "acme~u@1"]  # a@1 is also in a slot: counted there
    rows = residency_rows(
        slots, host, pinned=["p@1"], ranks={"a@1": 8, "acme~s@1": 16, "evil~t@2": 16}, host_cap=2
    )
    assert rows == {
        ResidencyRow("a", "slot", "8", "false"): 1,
        ResidencyRow("private", "slot", "16", "false"): 2,  # two tenants' adapters, one row
        ResidencyRow("p", "slot", "unknown", "true"): 1,
        # host, sorted: acme~u, h1 named (cap 2), h2 and h3 folded
        ResidencyRow("private", "host", "unknown", "false"): 1,
        ResidencyRow("h1", "host", "unknown", "false"): 1,
        ResidencyRow(OTHER, "host", "unknown", "false"): 2,
    }
    assert "acme" not in repr(rows) and "evil" not in repr(rows)


def test_residency_labels_are_bounded_by_slots_and_the_host_cap() -> None:
    slots = [f"s{i}@1" for i in range(8)]
    host = [f"h{i:05d}@1" for i in range(5000)]
    rows = residency_rows(slots, host, pinned=[], ranks={})
    assert len(rows) <= 8 + 64 + 1
    assert sum(rows.values()) == 8 + 5000


@dataclass
class _Gauge:
    sets: list[tuple[float, dict[str, str]]] = field(default_factory=list)

    def set(self, value: float, tags: dict[str, str]) -> None:
        self.sets.append((value, dict(tags)))


class _Engine:
    def __init__(self, adapters: RequestAdapters) -> None:
        self._adapters = adapters

    def request_adapters(self) -> RequestAdapters:
        return self._adapters


def test_replica_exports_lora_info_and_residency(monkeypatch: pytest.MonkeyPatch) -> None:
    lora, residency = _Gauge(), _Gauge()
    monkeypatch.setattr(metrics, "vllm_lora_info", lambda: lora)
    monkeypatch.setattr(metrics, "adapter_residency", lambda: residency)
    engine = _Engine(RequestAdapters(running={"math@v2": 3, "acme~x@v1": 1}, waiting={}))
    stats = EngineStats(
        running=4,
        waiting=0,
        hot_set=["math@v2", "acme~x@v1"],
        pinned=[],
        free_slots=2,
        num_slots=4,
        host_resident=["code@v1", "math@v2"],
        adapter_ranks={"math@v2": 8},
    )
    before = time.time()
    ReplicaMetrics(engine, source=None, model_name="tiny-base")._export_adapters(stats)
    ((value, tags),) = lora.sets
    assert before <= value <= time.time()  # vLLM's semantics: the time of the update
    assert tags == {
        "max_lora": "4",
        "running_lora_adapters": "math,private",
        "waiting_lora_adapters": "",
    }
    got: dict[tuple[str, ...], Any] = {tuple(t.values()): v for v, t in residency.sets}
    assert got == {
        ("math", "slot", "8", "false"): 1,
        ("private", "slot", "unknown", "false"): 1,
        ("code", "host", "unknown", "false"): 1,
    }
    keys = metrics.SPECS[metric_names.ADAPTER_RESIDENCY].tags
    assert all(tuple(t) == keys for _, t in residency.sets)


def test_a_tenants_plain_named_adapter_is_private_by_its_owner() -> None:
    """A tenant's adapter published under a plain name (no `tenant~`) is hidden too: the
    replica asks its store who owns the name."""
    from deployments.replica.lora_info import lora_info_tags, residency_rows

    owned = {"evil-private"}

    def private(ref: str) -> bool:
        return ref.partition("@")[0] in owned

    tags = lora_info_tags({"evil-private@v1": 2, "pub@v1": 1}, {}, 8, private)
    assert tags["running_lora_adapters"] == "private,pub"
    rows = residency_rows(["evil-private@v1"], [], [], {}, private=private)
    assert [row.adapter for row in rows] == ["private"]
