"""`benchmarks.cpu_gemm` runs every variant it names on the same work and reports each against
oneDNN's packed fp32 kernel (one layer, two row counts: a smoke run, no timing asserted)."""

from __future__ import annotations

import pytest

from benchmarks import cpu_gemm
from kernels import cpu_panel_gemm


def test_every_variant_runs_and_is_compared_with_onednn(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cpu_gemm, "LAYERS", 1)
    rows = cpu_gemm.run([1, 7], reps=1)
    names = {r["variant"] for r in rows}
    assert {"plain_fp32", "plain_bf16"} <= names
    if cpu_panel_gemm.available():
        assert {"panel_fp32", "panel_bf16", "panel_bf16_x16"} <= names
    assert len(rows) == 2 * len(names) and {r["rows"] for r in rows} == {1, 7}
    for row in rows:
        assert row["ms"] > 0 and row["weight_gbps"] > 0
        if cpu_gemm.BASELINE in names:
            assert row["speedup_vs_onednn_fp32"] > 0
    assert "GB/s" in capsys.readouterr().out
