"""Writing a benchmark's result: one JSON file under benchmarks/results/, named on stdout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: str | Path, result: dict[str, Any]) -> Path:
    """Write `result` as indented JSON (non-JSON values as their str) and say where."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {path}")
    return path
