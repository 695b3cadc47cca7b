"""An fp32 or bf16 CPU engine serves its base GEMMs on the kind chosen per shape
(`model.packed_linear`): forced to the panel kernel (`kernels.cpu_panel_gemm`), every base weight
and the LM head are packed as panels of the model's dtype, the kernel really runs, and
mixed-adapter requests get the same tokens and logprobs as with the kernel switched off (oneDNN or
plain `F.linear`); left to measure, each weight runs on the kind its shape's table picked, and the
table is logged."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kernels import choice_cache, chooser, cpu_panel_gemm
from kernels.cpu_extension_build import CACHE_ENV
from kernels.cpu_panel_gemm import PanelWeight
from molora_runtime.engine.types import SamplingParams
from molora_runtime.model import packed_linear
from molora_runtime.model.layers import FusedLinear, LoRALinear
from tests.molora_runtime.rt_util import (
    assert_same_generations,
    build_engine,
    count_calls,
    random_prompts,
    request,
    run_to_completion,
)

pytestmark = pytest.mark.skipif(
    not cpu_panel_gemm.available(), reason="no AVX2/FMA CPU or no C++ compiler"
)


def _serve(
    tiny_llama: Path, tiny_adapters: dict[str, Path], dtype: str
) -> tuple[dict[str, dict], object]:
    engine = build_engine(tiny_llama, tiny_adapters, dtype=dtype, hot_set={"num_slots": 3})
    prompts = random_prompts(5, 256, [6, 11, 3, 9, 4], seed=3)
    routes = ["a", "b", "a:0.5,c:0.5", None, "c"]
    sampling = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0)
    reqs = [
        request(f"r{i}", p, route, sampling=sampling)
        for i, (p, route) in enumerate(zip(prompts, routes, strict=True))
    ]
    return run_to_completion(engine, reqs), engine.model


def _base_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    fused = [m for m in model.modules() if isinstance(m, FusedLinear)]
    members = {id(member) for f in fused for member in f.members}
    plain = [m for m in model.modules() if isinstance(m, LoRALinear) and id(m) not in members]
    return [*fused, *plain]


def _base_packs(model: torch.nn.Module) -> list[object]:
    return [m.packed for m in _base_modules(model)]


@pytest.mark.parametrize(
    ("dtype", "tolerance"),
    [("float32", 1e-4), ("bfloat16", 5e-2)],  # bf16: both sum in fp32, in another order
)
def test_cpu_engine_runs_on_panels_and_matches_the_plain_path(
    tiny_llama: Path,
    tiny_adapters: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    dtype: str,
    tolerance: float,
) -> None:
    monkeypatch.setenv(packed_linear.GEMM_ENV, "panel")
    calls = count_calls(monkeypatch, cpu_panel_gemm, "panel_linear")
    with caplog.at_level(logging.INFO, logger="molora_runtime.engine.engine"):
        panel, model = _serve(tiny_llama, tiny_adapters, dtype)
    assert f"CPU base GEMMs run on the panel GEMM ({dtype} panels) x" in caplog.text
    packs = [*_base_packs(model), model.packed_head]
    assert all(isinstance(p, PanelWeight) for p in packs)
    assert all(p.panels.dtype == getattr(torch, dtype) for p in packs)
    assert calls, "the CPU engine never ran the panel GEMM"

    monkeypatch.setenv(cpu_panel_gemm.SWITCH_ENV, "0")
    packed_linear.CHOOSER.forget()  # the forced panel picks held for the process
    plain, model = _serve(tiny_llama, tiny_adapters, dtype)
    assert not any(isinstance(p, PanelWeight) for p in _base_packs(model))
    assert_same_generations(panel, plain, tolerance)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_engine_runs_each_shape_on_the_kind_measured_fastest(
    tiny_llama: Path,
    tiny_adapters: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
    dtype: str,
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(packed_linear.GEMM_ENV, raising=False)
    packed_linear.CHOOSER.forget()
    with caplog.at_level(logging.INFO):
        _, model = _serve(tiny_llama, tiny_adapters, dtype)
    weights = [*(m.weight for m in _base_modules(model)), model._head_weight()]
    packs = [*_base_packs(model), model.packed_head]
    for i, (weight, packed) in enumerate(zip(weights, packs, strict=True)):
        rows = packed_linear.HEAD_ROWS if i == len(weights) - 1 else packed_linear.BASE_ROWS
        key = packed_linear.shape_key(weight, rows)
        table = choice_cache.load(key)
        assert table is not None, key
        kind = chooser.pick(table, allowed=packed_linear.runnable_kinds(weight))
        expected = {"panel": PanelWeight, "onednn": torch.Tensor, "plain": type(None)}[kind]
        assert isinstance(packed, expected), (key, kind, type(packed))
        assert caplog.text.count(f"CPU GEMM for {key} (measured") == 1
    assert "CPU base GEMMs run on" in caplog.text
