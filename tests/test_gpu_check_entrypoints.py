"""Every Python entry point scripts/gpu_check.sh calls imports and parses its args on a CPU.

The GPU box is lent rarely and briefly; a typo in a benchmark's argparse must not cost a run.
The entry points are read from the script itself, so a new one is covered without editing this.
"""

from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def entry_points() -> list[str]:
    """`-m module` or `path.py` of each `"$PY" ...` call (the inline summary heredoc excluded)."""
    found = re.findall(r'"\$PY" (-m [\w.]+|[\w/]+\.py)', SCRIPT.read_text())
    return sorted(set(found))


def test_the_script_calls_the_expected_entry_points() -> None:
    assert set(entry_points()) >= {
        "-m tests.gpu.run_checks",
        "-m benchmarks.kernels",
        "-m benchmarks.paged_attention",
        "-m benchmarks.decode_step",
    }


@pytest.mark.parametrize("entry", entry_points())
def test_entry_point_parses_help(entry: str, monkeypatch, capsys) -> None:
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", [entry.split()[-1], "--help"])
    with pytest.raises(SystemExit) as done:
        if entry.startswith("-m "):
            runpy.run_module(entry.split()[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(str(ROOT / entry), run_name="__main__")
    assert done.value.code == 0
    assert "usage" in capsys.readouterr().out.lower()
