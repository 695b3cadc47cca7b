"""Measured choice tables kept on disk per machine kind, so a restart does not time them again.

A table holds for one CPU model with one set of flags, one torch version and one thread count:
those make the file's name (a hash) and are stored in it; any change starts a new file. The file
lives in the kernel cache (private to the user, 0700) and is written whole and renamed into
place. It only ranks candidates that all compute the same result, so a damaged or edited file
can at worst slow a shape down, never change a result; one that does not parse is measured anew.
Every decision of `kernels.chooser` (GEMM, attention, LoRA) shares the one file, by shape key.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import threading
from pathlib import Path

import torch
from pydantic import BaseModel, ValidationError

from kernels.cpu_extension_build import cache_root, private_dir

log = logging.getLogger(__name__)

# candidate -> size (rows, batch, tokens) -> median seconds of one call
Table = dict[str, dict[int, float]]
FILE_PREFIX = "cpu-choices-"

_lock = threading.Lock()


class ChoiceFile(BaseModel):
    """The machine a file's tables hold for, and the tables: shape key -> candidate -> seconds
    by size."""

    machine: dict[str, str]
    tables: dict[str, dict[str, dict[int, float]]] = {}


def _cpuinfo() -> tuple[str, str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine(), ""
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line and line.strip())
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    return fields.get("model name", platform.machine()), fields.get("flags", "")


def machine() -> dict[str, str]:
    """What a measured table depends on besides the shape: CPU model and flags, torch, threads."""
    model, flags = _cpuinfo()
    return {
        "cpu_model": model,
        "cpu_flags_sha256": hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest(),
        "torch_version": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": str(torch.get_num_threads()),
    }


def path_for(fingerprint: dict[str, str]) -> Path:
    """This machine kind's file in the kernel cache."""
    key = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / f"{FILE_PREFIX}{key}.json"


def _read(path: Path, fingerprint: dict[str, str]) -> ChoiceFile:
    try:
        found = ChoiceFile.model_validate_json(path.read_text())
    except FileNotFoundError:
        return ChoiceFile(machine=fingerprint)
    except (OSError, ValidationError, ValueError) as exc:
        log.warning("ignoring the unreadable choice file %s: %s", path, exc)
        return ChoiceFile(machine=fingerprint)
    return found if found.machine == fingerprint else ChoiceFile(machine=fingerprint)


def load(key: str) -> Table | None:
    """The stored table for shape `key` on this machine, if any."""
    fingerprint = machine()
    table = _read(path_for(fingerprint), fingerprint).tables.get(key)
    return {name: dict(times) for name, times in table.items()} if table else None


def store(key: str, table: Table) -> None:
    """Add (or replace) shape `key`'s table in this machine's file; a cache that cannot be
    written is logged and skipped (the table was measured, serving goes on)."""
    fingerprint = machine()
    with _lock:
        try:
            path = path_for(fingerprint)
            private_dir(path.parent)
            current = _read(path, fingerprint)
            current.tables[key] = table
            partial = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(current.model_dump_json(indent=1))
            os.replace(partial, path)
        except (OSError, RuntimeError) as exc:
            log.warning("choice not cached: %s", exc)
