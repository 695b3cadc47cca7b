"""Base GEMMs on the kind measured fastest per shape (`model.packed_linear`): every kind that runs
here equals its twin (`F.linear` in fp32) on fp32 and bf16 weights; for fp32 weights only kinds
that give a row the same bits alone as in a batch are chosen; the choice comes from this machine's stored table
when there is one and is measured (and stored) when not; a forced kind is honoured where it runs,
and a misspelled one is refused."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kernels import choice_cache, chooser
from kernels.cpu_extension_build import CACHE_ENV
from kernels.cpu_panel_gemm import PanelWeight, panel_linear_reference
from molora_runtime.model import packed_linear as pl


@pytest.fixture(autouse=True)
def fresh_choices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(pl.GEMM_ENV, raising=False)
    pl.CHOOSER.forget()
    yield
    pl.CHOOSER.forget()  # picks made on this test's rigged tables stay with it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(37, 19), (64, 96), (200, 48)])
@pytest.mark.parametrize("m", [1, 7, 64])
def test_every_kind_equals_its_twin(dtype: torch.dtype, n: int, k: int, m: int) -> None:
    g = torch.Generator().manual_seed(n * 1000 + k + m)
    weight = torch.randn(n, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    x = torch.randn(m, k, generator=g).to(dtype)
    want = panel_linear_reference(x, weight, bias)
    kinds = pl.runnable_kinds(weight)
    assert kinds[-1] == "plain"
    for kind in kinds:
        with torch.inference_mode():
            got = pl.linear(x, weight, bias, pl.pack_as(weight, kind))
        assert got.dtype == dtype and got.shape == (m, n), kind
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * k**0.5, msg=kind)
        else:  # bf16 products summed in fp32 in another order, rounded once or twice
            torch.testing.assert_close(got, want, rtol=2**-6, atol=2e-2 * k**0.5, msg=kind)


def _allowed(weight: torch.Tensor, rows=pl.BASE_ROWS) -> list[str]:
    """The kinds `choose_kind` picks among for `weight` (row-invariant ones for fp32)."""
    kinds = pl.runnable_kinds(weight)
    if weight.dtype != torch.float32:
        return kinds
    return [k for k in kinds if pl.row_invariant(weight, k, rows)] or kinds


EXPECTED_TYPE = {"panel": PanelWeight, "onednn": torch.Tensor, "plain": type(None)}


def test_a_shape_is_measured_once_stored_and_then_taken_from_the_store(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    weight = torch.randn(48, 32)
    key = pl.shape_key(weight, pl.BASE_ROWS)
    allowed = _allowed(weight)
    with caplog.at_level(logging.INFO, logger=pl.__name__):
        kind = pl.choose_kind(weight)
    assert f"CPU GEMM for {key} (measured" in caplog.text
    stored = choice_cache.load(key)
    assert stored is not None and set(stored) == set(allowed)
    assert all(set(times) == set(pl.BASE_ROWS) for times in stored.values())
    assert kind == chooser.pick(stored)

    # a new process (no in-memory choice) follows the stored table, whatever it says
    winner = next(k for k in reversed(allowed) if k != kind) if len(allowed) > 1 else kind
    rigged = {k: dict.fromkeys(pl.BASE_ROWS, 1e-3) for k in stored}
    rigged[winner] = dict.fromkeys(pl.BASE_ROWS, 1e-6)
    choice_cache.store(key, rigged)
    pl.CHOOSER.forget()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=pl.__name__):
        assert pl.choose_kind(weight) == winner
        assert isinstance(pl.pack_chosen(weight), EXPECTED_TYPE[winner])
    assert f"CPU GEMM for {key} (stored" in caplog.text
    assert caplog.text.count("CPU GEMM for") == 1  # the table is logged once per shape


def test_a_stored_table_without_a_kind_that_now_runs_is_measured_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    weight = torch.randn(40, 24)
    key = pl.shape_key(weight, pl.BASE_ROWS)
    allowed = _allowed(weight)
    choice_cache.store(key, {allowed[-1]: dict.fromkeys(pl.BASE_ROWS, 1e-6)})
    with caplog.at_level(logging.INFO, logger=pl.__name__):
        pl.choose_kind(weight)
    if len(allowed) > 1:
        assert "(measured" in caplog.text
    assert set(choice_cache.load(key) or {}) == set(allowed)


@pytest.mark.parametrize(("n", "k"), [(960, 576), (576, 1536), (72, 40)])
def test_the_chosen_fp32_kind_gives_a_row_the_same_bits_alone_as_in_a_batch(
    caplog: pytest.LogCaptureFixture, n: int, k: int
) -> None:
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k))
    with caplog.at_level(logging.INFO, logger=pl.__name__):
        kind = pl.choose_kind(weight)
    packed = pl.pack_as(weight, kind)
    x = torch.randn(256, k, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        batch = pl.linear(x, weight, None, packed)
        for i, m in ((0, 1), (5, 1), (63, 1), (8, 32), (0, 64)):
            assert torch.equal(pl.linear(x[i : i + m], weight, None, packed), batch[i : i + m])
    found = re.search(r"not row-invariant here, left out: ([a-z, ]+)\)", caplog.text)
    dropped = found.group(1).split(", ") if found else []
    for other in pl.runnable_kinds(weight):
        invariant = pl.row_invariant(weight, other, pl.BASE_ROWS)
        assert (other in dropped) == (not invariant) and (invariant or other != kind)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_forced_kind_is_used_where_it_runs(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    weight = torch.randn(24, 16).to(dtype)
    for kind in pl.runnable_kinds(weight):
        monkeypatch.setenv(pl.GEMM_ENV, kind.upper())
        packed = pl.pack_chosen(weight)
        expected = {"panel": PanelWeight, "onednn": torch.Tensor, "plain": type(None)}[kind]
        assert isinstance(packed, expected), kind
    assert not list(
        Path(choice_cache.cache_root()).glob(f"{choice_cache.FILE_PREFIX}*")
    )  # nothing timed


def test_a_forced_kind_that_cannot_run_falls_back_to_measuring_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("MOLORA_CPU_PANEL_GEMM", "0")
    monkeypatch.setenv(pl.GEMM_ENV, "panel")
    with caplog.at_level(logging.INFO, logger=pl.__name__):
        packed = pl.pack_chosen(torch.randn(24, 16))
    assert not isinstance(packed, PanelWeight)
    assert "cannot run" in caplog.text and "(measured" in caplog.text


def test_a_misspelled_forced_kind_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(pl.GEMM_ENV, "fastest")
    with pytest.raises(ValueError, match="MOLORA_CPU_GEMM='fastest'"):
        pl.pack_chosen(torch.randn(8, 8))


def test_weights_the_chooser_does_not_cover_keep_onednn_or_plain() -> None:
    half = torch.randn(16, 16, dtype=torch.float16)
    assert pl.pack_chosen(half) is None or isinstance(pl.pack_chosen(half), torch.Tensor)
    assert not list(Path(choice_cache.cache_root()).glob(f"{choice_cache.FILE_PREFIX}*"))


def test_measuring_leaves_the_global_rng_where_it_was() -> None:
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    pl.choose_kind(torch.randn(32, 16, generator=torch.Generator().manual_seed(0)))
    assert torch.equal(torch.rand(4), expected)
