"""Every Python entry point scripts/gpu_check.sh calls imports and parses its args on a CPU.

The GPU box is lent rarely and briefly; a typo in a benchmark's argparse must not cost a run.
The entry points are read from the script itself, so a new one is covered without editing this.
"""

from __future__ import annotations

import json
import re
import runpy
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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


# ----- the benchmarks' dry runs: the GPU code path on a CPU, tiny, in seconds ----------------
# `--help` proves the arguments parse; these prove the rest cannot crash on a lent GPU for a
# reason a CPU would show: the tables, the JSON, the skip reasons, the ratios to base.


def _written(out: str) -> Path:
    """The JSON path a benchmark printed (`wrote PATH`)."""
    return Path(next(line for line in out.splitlines() if line.startswith("wrote "))[6:])


def test_kernels_dry_run_reports_both_clocks(tmp_path: Path, monkeypatch, capsys) -> None:
    import torch

    from benchmarks import kernels

    monkeypatch.chdir(ROOT)
    out = tmp_path / "kernels.json"
    args = ["--device", "cpu", "--dry-run", "--peak-bw", "1e10", "--threads", "1"]
    threads = torch.get_num_threads()  # main() sets the CPU thread count: restore this process's
    try:
        assert kernels.main([*args, "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    result = json.loads(out.read_text())
    assert result["dry_run"] and result["peak_source"] == "argument"
    assert {"graph_device_us", "eager_wall_us", "bw_frac"} <= set(result["timing"])
    rows = result["rows"]
    assert {r["variant"] for r in rows} == {"ref:gather", "ref:segmented"}
    for r in rows:
        assert r["eager_wall_us"] > 0
        if r["variant"] == "ref:segmented":  # syncs with the host: no graph figure, and why
            assert r["graph_device_us"] is None and "not capturable" in r["graph_note"]
            assert r["bw_frac"] is None and r["basis"] == "eager_wall"
        else:
            assert r["graph_device_us"] > 0 and r["bw_frac"] > 0 and r["basis"] == "graph_device"
    assert set(result["targets"]) >= {"decode_bw_target_0.70_met", "per_token_target_3.6_met"}
    assert "graph us" in capsys.readouterr().out


def test_decode_step_dry_run_measures_every_case(monkeypatch, capsys) -> None:
    from benchmarks import decode_step
    from benchmarks.report import RESULTS_DIR

    monkeypatch.chdir(ROOT)
    argv = ["--device", "cpu", "--dry-run", "--peak-bw", "1e10"]
    assert decode_step.main([*argv, "--shape", "smollm2", "--shape", "llama3-8b"]) == 0
    path = _written(capsys.readouterr().out)
    assert not path.resolve().is_relative_to(RESULTS_DIR)  # a dry run writes to a temp dir
    result = json.loads(path.read_text())
    rows = result["rows"]
    shapes, batches = result["settings"]["shapes"], result["settings"]["batches"]
    assert set(shapes) == {"smollm2", "llama3-8b"} and batches == [1, 4]
    assert len(rows) == len(shapes) * len(batches) * 2 * len(decode_step.CASES)
    assert [r for r in rows if r["skipped"]] == []
    for r in rows:
        assert r["step_device_ms"]["p50"] > 0 and r["forward_device_ms"]["p50"] > 0
        assert r["bytes_per_step"]["total"] >= r["bytes_per_step"]["weights"] > 0
        assert r["hbm_frac_forward"] > 0 and r["vs_base_step"] > 0
        assert (r["bytes_per_step"]["lora"] == 0) == (r["case"] == "base")
    assert any(key.endswith("target 1.1 met") for key in result["targets"])
    shutil.rmtree(path.parent)


def test_decode_step_cuda_defaults_are_the_issue_grid() -> None:
    """What `--device cuda` alone runs (resolved here without a GPU): 3 shapes, the 8B class
    cut to 8 layers, b=1/32/128, a budget under the script's 150 s timeout, the results dir."""
    from benchmarks import decode_step
    from benchmarks.report import RESULTS_DIR

    settings, out, peak = decode_step.parse_args(["--device", "cuda"])
    layers = {name: shape.num_layers for name, shape in settings.shapes.items()}
    assert layers == {"smollm2": 30, "qwen2.5-1.5b": 28, "llama3-8b:8": 8}
    assert settings.shapes["llama3-8b:8"].full_layers == 32
    assert settings.batches == [1, 32, 128] and settings.dtype == "bfloat16"
    assert settings.max_seconds is not None and settings.max_seconds < 150
    assert out == RESULTS_DIR / "decode_step_cuda.json" and peak is None
    exact, _, _ = decode_step.parse_args(["--device", "cuda", "--shape", "llama3-8b:2"])
    assert list(exact.shapes) == ["llama3-8b:2"]


def test_decode_step_budget_skips_with_a_reason(tmp_path: Path, monkeypatch) -> None:
    from benchmarks import decode_step

    monkeypatch.chdir(ROOT)
    out = tmp_path / "step.json"
    argv = ["--device", "cpu", "--dry-run", "--max-seconds", "0", "--out", str(out)]
    assert decode_step.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["budget_spent"] and result["rows"]
    assert all("--max-seconds" in r["skipped"] for r in result["rows"])


@pytest.mark.parametrize("module", ["benchmarks.kernels", "benchmarks.decode_step"])
def test_dry_run_refuses_the_results_dir(module: str, monkeypatch) -> None:
    import importlib

    from benchmarks.report import RESULTS_DIR

    monkeypatch.chdir(ROOT)
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as done:
        main(["--device", "cpu", "--dry-run", "--out", str(RESULTS_DIR / "x.json")])
    assert done.value.code == 2
