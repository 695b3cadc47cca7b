"""Where adapters and compositions come from: the engine only ever asks for a local folder.

The adapter store (`adapter_store`) implements `AdapterSource` over S3 or a registry directory
with a verified local cache; `DirectorySource` serves plain PEFT folders for the offline API.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from molora_runtime.errors import AdapterNotFoundError

__all__ = ["AdapterNotFoundError", "AdapterSource", "DirectorySource"]


@runtime_checkable
class AdapterSource(Protocol):
    """Resolves `name` or `name@version` to a local folder holding the files."""

    def adapter_path(self, ref: str) -> Path:
        """Local PEFT folder (adapter_config.json + adapter_model.safetensors)."""
        ...

    def composition_path(self, ref: str) -> Path:
        """Local composition folder (composition.json + gates.safetensors)."""
        ...


class DirectorySource:
    """A fixed mapping of names to local folders (the offline `LLM(adapters={...})` case)."""

    def __init__(
        self,
        adapters: dict[str, str | Path] | None = None,
        compositions: dict[str, str | Path] | None = None,
    ) -> None:
        self._adapters = {k: Path(v) for k, v in (adapters or {}).items()}
        self._compositions = {k: Path(v) for k, v in (compositions or {}).items()}

    def adapter_path(self, ref: str) -> Path:
        if ref not in self._adapters:
            raise AdapterNotFoundError(f"unknown adapter {ref!r}; known: {sorted(self._adapters)}")
        return self._adapters[ref]

    def composition_path(self, ref: str) -> Path:
        if ref not in self._compositions:
            raise AdapterNotFoundError(
                f"unknown composition {ref!r}; known: {sorted(self._compositions)}"
            )
        return self._compositions[ref]
