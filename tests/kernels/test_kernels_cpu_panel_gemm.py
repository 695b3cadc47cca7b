"""The CPU panel GEMM (`kernels.cpu_panel_gemm`) equals its twin, `F.linear` in fp32 rounded to the
input's dtype, over random shapes (row counts across the 6-row tile and its remainders, widths
across the 16-column panel and a padded last panel, strided input rows, with and without bias;
fp32 and bf16 panels, fp32 and bf16 inputs); it refuses what it cannot run
rather than read past a buffer; and where this CPU and a compiler can run it, it is built, not
silently skipped; where it cannot, the fallback says so."""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils import cpp_extension

from kernels import cpu_extension_build, cpu_kernel
from kernels import cpu_panel_gemm as pg
from kernels.cpu_extension_build import CACHE_ENV

needs_kernel = pytest.mark.skipif(not pg.available(), reason="no AVX2/FMA CPU or no C++ compiler")


def test_kernel_is_built_wherever_it_can_run() -> None:
    can_build = (
        cpu_kernel.cpu_supported()
        and cpu_kernel.compiler() is not None
        and cpp_extension.is_ninja_available()
    )
    assert pg.available() == can_build


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    m=st.integers(0, 40),  # AVX2 tiles of 6 rows, AVX-512 tiles of 12, and their remainders
    n=st.integers(1, 70),
    k=st.integers(1, 100),
    row_gap=st.integers(0, 7),
    with_bias=st.booleans(),
    weight_dtype=st.sampled_from(pg.PANEL_DTYPES),
    x_dtype=st.sampled_from(pg.PANEL_DTYPES),
    allow_avx512=st.booleans(),
)
def test_panel_linear_matches_its_twin(
    seed: int,
    m: int,
    n: int,
    k: int,
    row_gap: int,
    with_bias: bool,
    weight_dtype: torch.dtype,
    x_dtype: torch.dtype,
    allow_avx512: bool,
) -> None:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g).to(weight_dtype)
    wide = torch.randn(m, k + row_gap, generator=g).to(x_dtype)
    x = wide[:, :k]  # rows `k + row_gap` apart: the kernel reads the row stride, no copy
    bias = torch.randn(n, generator=g).to(weight_dtype) if with_bias else None
    packed = pg.pack(weight)
    assert packed.panels.dtype == weight_dtype  # bf16 stays bf16: half the bytes to stream
    got = pg.panel_linear(x, packed, bias, allow_avx512=allow_avx512)  # both tile sets
    want = pg.panel_linear_reference(x, weight, bias)
    assert got.shape == want.shape == (m, n) and got.dtype == x_dtype
    if x_dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * k**0.5)
    else:  # both sum exactly the same products in fp32; rounding to bf16 may differ by one step
        torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-5 * k**0.5)


@needs_kernel
def test_bf16_panels_widen_every_bit_pattern_exactly() -> None:
    # one-hot rows pick single weights: the fp32 result must be the bf16 weight itself, exactly
    weight = torch.randn(37, 19).mul(1e3).to(torch.bfloat16)
    weight[0, :3] = torch.tensor([3e38, -3e38, 2**-100], dtype=torch.bfloat16)  # range ends
    for allow_avx512 in (False, True):
        got = pg.panel_linear(torch.eye(19), pg.pack(weight), allow_avx512=allow_avx512)
        assert torch.equal(got, weight.float().t())


@needs_kernel
def test_column_strided_input_is_made_contiguous_not_misread() -> None:
    weight = torch.randn(24, 10)
    x = torch.randn(10, 5).t()  # stride (1, 5): the kernel needs unit stride along features
    torch.testing.assert_close(pg.panel_linear(x, pg.pack(weight)), x @ weight.t())


@needs_kernel
def test_bad_inputs_are_refused_before_the_kernel_reads_them() -> None:
    packed = pg.pack(torch.randn(20, 8))
    with pytest.raises(ValueError, match="features"):
        pg.panel_linear(torch.randn(3, 9), packed)
    with pytest.raises(ValueError, match="fp32"):
        pg.panel_linear(torch.randn(3, 8, dtype=torch.float64), packed)
    with pytest.raises(ValueError, match="2-D"):
        pg.panel_linear(torch.randn(2, 3, 8), packed)
    with pytest.raises(ValueError, match="fp32 or bf16"):
        pg.pack(torch.randn(4, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="panels must be"):  # a layout the kernel would overrun
        pg.PanelWeight(panels=torch.zeros(1, 8, 16), out_features=20, in_features=8)
    with pytest.raises(ValueError, match="panels must be"):
        pg.PanelWeight(panels=torch.zeros(2, 16, 8).transpose(1, 2), out_features=20, in_features=8)


def test_a_failing_compiler_is_reported_with_its_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = shutil.which("c++") or "c++"
    fake = tmp_path / "broken-c++"  # answers --version like the real one, fails every compile
    fake.write_text(
        f'#!/bin/sh\nif [ "$1" = --version ]; then exec {real} --version; fi\n'
        "echo 'fatal: no such target' >&2\nexit 1\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match="no such target"):
        pg.KERNEL.build()
    assert not list((tmp_path / "cache").glob("*"))  # no half-written library left behind


def test_no_compiler_falls_back_loudly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    fresh = dataclasses.replace(pg.KERNEL)  # the same kernel, not yet loaded in this process
    with caplog.at_level(logging.WARNING, logger=cpu_kernel.__name__):
        assert fresh.library() is None
    assert "CPU panel GEMM unavailable" in caplog.text and "no C++ compiler" in caplog.text


@needs_kernel
@pytest.mark.slow  # runs the compiler
def test_build_goes_to_the_private_cache_and_is_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    assert pg.KERNEL.build().panel_width() == pg.PANEL_WIDTH
    built = cpu_extension_build.verified_library(pg.SPEC)
    assert built is not None and built.parent == tmp_path / "cache" / pg.SPEC.module
    assert (tmp_path / "cache").stat().st_mode & 0o777 == 0o700
    stamp = built.stat().st_mtime_ns
    entries = sorted((tmp_path / "cache").iterdir())
    # verified and imported, not compiled again
    assert pg.KERNEL.build().panel_width() == pg.PANEL_WIDTH
    assert built.stat().st_mtime_ns == stamp and sorted((tmp_path / "cache").iterdir()) == entries


@needs_kernel
def test_avx512_tiles_run_wherever_the_cpu_has_them() -> None:
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    assert pg.has_avx512() == ("avx512f" in flags)


def test_switch_turns_the_kernel_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(pg.SWITCH_ENV, "0")
    assert not pg.available()
