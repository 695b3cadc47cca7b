"""A bf16 CPU engine serves mixed adapters through packed LoRA GEMMs: same tokens and logprobs
as through the plain stacked GEMMs (`kernels.stacked`), and the packed path is really taken."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import molora_runtime.model.layers as layers
from molora_runtime.engine.types import SamplingParams
from molora_runtime.model.packed_linear import pack_weight
from tests.runtime.rt_util import (
    assert_same_generations,
    build_engine,
    count_calls,
    random_prompts,
    request,
    run_to_completion,
)

pytestmark = pytest.mark.skipif(
    pack_weight(torch.zeros(8, 8, dtype=torch.bfloat16)) is None,
    reason="no bf16 packing (panels or oneDNN) here",
)


def _run(tiny_llama: Path, tiny_adapters: dict[str, Path]) -> dict[str, dict]:
    engine = build_engine(tiny_llama, tiny_adapters, dtype="bfloat16", hot_set={"num_slots": 3})
    prompts = random_prompts(6, 256, [5, 9, 3, 12, 7, 4], seed=7)
    routes = ["a", "b", "c", "a:0.6,b:0.4", None, "c"]
    sampling = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0)
    reqs = [
        request(f"r{i}", p, route, sampling=sampling)
        for i, (p, route) in enumerate(zip(prompts, routes, strict=True))
    ]
    return run_to_completion(engine, reqs)


def test_packed_and_plain_lora_gemms_serve_the_same_tokens(
    tiny_llama: Path, tiny_adapters: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    used = count_calls(monkeypatch, layers, "routed_lora_packed")
    packed = _run(tiny_llama, tiny_adapters)
    assert used, "the bf16 CPU engine never took the packed LoRA path"
    monkeypatch.setattr(layers, "packed_ready", lambda x: False)
    assert_same_generations(packed, _run(tiny_llama, tiny_adapters), tolerance=0.05)
