"""Where a slot's weights come from: store -> local folder -> parsed and checked in host memory.

The host tier's background workers run `fetch` (off the step); the hot-set only copies what is
already parsed. Also the disk tier's view, for residency and tier reports.
"""

from __future__ import annotations

import time
from typing import Any

from adapter_store import base_model
from adapter_store.errors import RuleError
from molora_runtime.config import HotSetConfig
from molora_runtime.errors import AdapterLoadError
from molora_runtime.lora.host_tier import HostTier
from molora_runtime.lora.peft_adapter import AdapterWeights, arch_identity, read_peft_adapter
from molora_runtime.lora.source import AdapterSource
from molora_runtime.lora.tiers import StageTimes
from molora_runtime.model.arch import ModelArch


class AdapterLoader:
    """Fetches, parses and checks adapters for one base model (and keeps them in `host`)."""

    def __init__(
        self,
        arch: ModelArch,
        config: HotSetConfig,
        source: AdapterSource,
        served_names: list[str],
    ) -> None:
        self.arch = arch
        self.config = config
        self.source = source
        # Names the served base model goes by (alias, folder, HF id): what adapters must declare.
        self.served_names = served_names
        self.stages = StageTimes()  # fetch / parse / copy latencies
        self.host = HostTier(self.fetch, config.host_bytes, workers=config.fetch_workers)

    def read(self, name: str) -> AdapterWeights:
        """The parsed adapter, fetched now if the host tier does not hold it."""
        return self.host.read_now(name)

    def check_adapter(self, name: str) -> None:
        """Validate that `name` exists; a store source checks its manifest only (the files
        are fetched by the host tier's workers), a plain source resolves the folder."""
        check = getattr(self.source, "check_adapter", None)
        if callable(check):
            check(name)
        else:
            self.source.adapter_path(name)

    def pin(self, name: str) -> None:
        """Keep `name` parsed in host memory and in the disk cache."""
        self.host.pin(name)
        pin_on_disk = getattr(self.source, "pin", None)
        if callable(pin_on_disk):
            pin_on_disk(name)

    def fetch(self, name: str) -> AdapterWeights:
        """Store -> local folder -> parsed weights (runs in the host tier's workers)."""
        start = time.perf_counter()
        folder = self.source.adapter_path(name)
        fetched = time.perf_counter()
        self.stages.observe("fetch", fetched - start)
        weights = read_peft_adapter(
            name, folder, self.arch, self.config.target_modules, self.config.max_rank
        )
        if not self.config.allow_base_mismatch:
            self._check_base(name, weights.base_model)
        self.stages.observe("parse", time.perf_counter() - fetched)
        return weights

    def _check_base(self, name: str, declared: str | None) -> None:
        """Refuse an adapter published for another base model (the rulebook decides)."""
        lookup = getattr(self.source, "adapter_identity", None)
        identity = None
        if callable(lookup):
            try:
                identity = lookup(name)
            except Exception:  # the manifest is advisory here; the files are already checked
                identity = None
        try:
            base_model.check_declared_base(
                declared, identity, self.served_names or [self.arch.name_or_path],
                arch_identity(self.arch),
            )  # fmt: skip
        except RuleError as exc:
            raise AdapterLoadError(
                f"adapter {name!r} {exc} (hot_set.allow_base_mismatch=true serves it anyway)"
            ) from None

    def disk(self) -> dict[str, Any]:
        """The source's disk-cache report ({} for a plain directory source)."""
        report = getattr(self.source, "disk_tier", None)
        if not callable(report):
            return {}
        try:
            return dict(report())
        except Exception:  # stats must never fail a replica
            return {}

    def on_disk(self, name: str) -> bool:
        on_disk = getattr(self.source, "on_disk", None)
        return bool(callable(on_disk) and on_disk(name))
