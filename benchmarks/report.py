"""Writing a benchmark's result: one JSON file under benchmarks/results/, named on stdout."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from adapter_store.config import DEFAULT_LOCAL_STORE
from benchmarks.machine import machine_info

RESULTS_DIR = Path(__file__).resolve().parent / "results"
FIGURES_DIR = Path(__file__).resolve().parents[1] / "docs" / "figures"  # plots the docs show
BUNDLED_STORE = Path(__file__).resolve().parents[1] / DEFAULT_LOCAL_STORE  # the shipped store
REPO_ROOT = Path(__file__).resolve().parents[1]


def write_json(path: str | Path, result: dict[str, Any]) -> Path:
    """Write `result` as indented JSON (non-JSON values as their str), with the box it ran on
    under `machine_info`, and say where."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    result = {**result, "machine_info": result.get("machine_info") or machine_info()}
    path.write_text(portable(json.dumps(result, indent=2, default=str)) + "\n")
    print(f"wrote {path}")
    return path


def portable(text: str) -> str:
    """`text` with this machine's paths written as the reader would have them: the checkout's
    relative to its root, the temp directory as `$TMPDIR`, the home directory as `~`."""
    for where, name in (
        (REPO_ROOT, ""),
        (Path(tempfile.gettempdir()), "$TMPDIR/"),
        (Path.home(), "~/"),
    ):
        text = text.replace(f"{where}/", name).replace(f'"{where}"', f'"{name.rstrip("/") or "."}"')
    return text
