"""A benchmark's JSON names no path of the machine that wrote it."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from benchmarks.report import REPO_ROOT, portable, write_json


def test_machine_paths_are_written_portably(tmp_path: Path) -> None:
    tmp = Path(tempfile.gettempdir())
    result = {
        "args": {
            "out": str(REPO_ROOT / "benchmarks" / "results" / "x.json"),
            "root": str(REPO_ROOT),
        },
        "work": str(tmp / "bench"),
        "cmd": [f"a={REPO_ROOT / 'deployments' / 'default_store' / 'adapters' / 'a'}"],
        "cache": str(Path.home() / ".cache" / "molora"),
        "machine_info": {"cpu": "test"},
    }
    out = json.loads(write_json(tmp_path / "r.json", result).read_text())
    assert out["args"] == {"out": "benchmarks/results/x.json", "root": "."}
    assert out["work"] == "$TMPDIR/bench"
    assert out["cmd"] == ["a=deployments/default_store/adapters/a"]
    assert out["cache"] == "~/.cache/molora"
    text = json.dumps(out)
    for where in (str(REPO_ROOT), str(Path.home())):
        assert where + "/" not in text
    assert portable("nothing to change") == "nothing to change"
