"""`benchmarks.cpu_gemm` times every kind that runs here on every shape it names, picks a winner
among them, adds the shapes up as a model pass, and records which CPU the result holds for (a
smoke run on small shapes: no timing asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import cpu_gemm
from molora_runtime.model.packed_linear import runnable_kinds


def test_every_shape_gets_a_table_a_winner_and_the_cpu_is_recorded(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(
        cpu_gemm, "SHAPES", {"a": (40, 24, 3, (1, 8, 64)), "head": (96, 24, 1, (1, 8))}
    )
    out = tmp_path / "cpu_gemm.json"
    assert cpu_gemm.main(["--reps", "1", "--threads", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["cpu"]["cpu"] and isinstance(result["cpu"]["flags"], list)
    assert set(result["cpu"]["isa"]) <= set(result["cpu"]["flags"])
    for dtype_name in ("float32", "bfloat16"):
        kinds = runnable_kinds(torch.zeros(8, 8, dtype=getattr(torch, dtype_name)))
        shapes = result["dtypes"][dtype_name]["shapes"]
        for shape in shapes.values():
            assert set(shape["table"]) == set(kinds) and shape["winner"] in kinds
            assert set(shape["row_invariant"]) == set(kinds)
            if dtype_name == "float32" and any(shape["row_invariant"].values()):
                assert shape["row_invariant"][shape["winner"]]
            scores = shape["scores"]  # relative to the fastest at each row count: never below 1
            assert min(scores.values()) >= 1.0 - 1e-9
        assert set(shapes["head"]["table"]["plain"]) == {"1", "8"}
        passes = result["dtypes"][dtype_name]["model_pass_seconds"]
        assert set(passes) == {*kinds, "chosen"}
        counts = {"a": 3, "head": 1}
        for m in ("1", "8"):  # the chosen pass runs each shape on its own winner
            want = sum(counts[n] * s["table"][s["winner"]][m] for n, s in shapes.items())
            assert passes["chosen"][m] == pytest.approx(want)
    text = capsys.readouterr().out
    assert "float32 a [40x24]" in text and "decode pass" in text
