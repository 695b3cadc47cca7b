"""A bf16 CPU engine serves mixed adapters the same through either CPU LoRA backend: packed
copies of the slot range or plain stacked GEMMs (`kernels.stacked`) give the same tokens and
logprobs, and the packed backend really runs on packed copies."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from molora_runtime.engine.types import SamplingParams
from molora_runtime.model.cpu_lora import PackedLoRA, StackedLoRA
from molora_runtime.model.packed_linear import pack_weight
from tests.molora_runtime.rt_util import (
    assert_same_generations,
    build_engine,
    random_prompts,
    request,
    run_to_completion,
)

pytestmark = pytest.mark.skipif(
    pack_weight(torch.zeros(8, 8, dtype=torch.bfloat16)) is None,
    reason="no bf16 packing (panels or oneDNN) here",
)


def _run(tiny_llama: Path, tiny_adapters: dict[str, Path], backend: StackedLoRA) -> dict:
    engine = build_engine(tiny_llama, tiny_adapters, dtype="bfloat16", hot_set={"num_slots": 3})
    assert isinstance(engine.hot_set.backend, StackedLoRA)  # chosen at start, by timing
    engine.hot_set.backend = backend
    prompts = random_prompts(6, 256, [5, 9, 3, 12, 7, 4], seed=7)
    routes = ["a", "b", "c", "a:0.6,b:0.4", None, "c"]
    sampling = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0)
    reqs = [
        request(f"r{i}", p, route, sampling=sampling)
        for i, (p, route) in enumerate(zip(prompts, routes, strict=True))
    ]
    return run_to_completion(engine, reqs)


def test_packed_and_plain_lora_backends_serve_the_same_tokens(
    tiny_llama: Path, tiny_adapters: dict[str, Path]
) -> None:
    packed = PackedLoRA()
    served = _run(tiny_llama, tiny_adapters, packed)
    assert packed._pairs, "the packed backend never built a packed slot range"
    plain = _run(tiny_llama, tiny_adapters, StackedLoRA())
    assert_same_generations(served, plain, tolerance=0.05)
