"""A CPU engine serves learned top-k routes through the grouped top-k delta kernel
(`kernels.cpu_topk_delta`) with the same greedy tokens (and logprobs to rounding) as through the
stacked delta it replaces, in fp32 over padded slots and over rank pools, for top-2 and top-1,
beside static routes in the same steps; and the kernel really runs. In bf16 (where a random tiny
model's near-tied logits flip greedy tokens on any rounding change) its logits stay as close to
the fp32 engine's as the stacked delta's: it sums in fp32 where the stacked GEMMs round to bf16."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kernels import cpu_topk_delta
from kernels.cpu_topk_delta import GroupedDelta
from molora_runtime.engine.types import SamplingParams
from molora_runtime.model.cpu_lora import (
    GroupedDeltas,
    GroupedLoRA,
    PackedLoRA,
    StackedLoRA,
)
from molora_runtime.model.rank_pools import PooledBackend
from molora_runtime.routes import LearnedRoute
from tests.molora_runtime.rt_util import (
    assert_same_generations,
    count_calls,
    engine_prefill_logits,
    random_prompts,
    request,
    run_to_completion,
)

pytestmark = pytest.mark.skipif(not cpu_topk_delta.available(), reason="no kernel here")

POOLS = [{"rank": 4, "slots": 1}, {"rank": 8, "slots": 1}, {"rank": 16, "slots": 1}]


LEARNED = [
    LearnedRoute(composition="moe"), LearnedRoute(composition="moe", top_k=1),
    LearnedRoute(composition="moe"), "a", LearnedRoute(composition="moe"),
]  # fmt: skip
STATIC = ["a", "b", "a:0.5+b:0.5", "b", "a"]


def _serve(
    factory: Callable[..., Any], grouped: bool, static: bool, calls: list, routes: list,
    **kwargs: Any,
) -> tuple[dict, int]:  # fmt: skip
    """Generations on the kernel for learned tables (`grouped`) and static ones (`static`), and
    how many kernel calls serving them made."""
    engine = factory(dtype="float32", **kwargs)
    backend = engine.hot_set.backend
    inner = getattr(backend, "inner", backend)  # rank pools wrap the engine's backend
    assert isinstance(inner, StackedLoRA)
    assert inner.grouped, "a CPU engine where the kernel runs chooses it at start"
    kernel = GroupedDeltas()
    chosen = GroupedLoRA(kernel) if static else StackedLoRA(kernel if grouped else None)
    engine.hot_set.backend = PooledBackend(chosen) if backend is not inner else chosen
    start = len(calls)  # the start-up timing of the backends calls the kernel too
    prompts = random_prompts(5, 256, [6, 11, 3, 8, 5], seed=11)
    sampling = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0)
    reqs = [
        request(f"r{i}", p, route, sampling=sampling)
        for i, (p, route) in enumerate(zip(prompts, routes, strict=True))
    ]
    return run_to_completion(engine, reqs), len(calls) - start


@pytest.mark.parametrize("hot_set", [{"num_slots": 3}, {"rank_pools": POOLS}])
def test_learned_routes_serve_the_same_tokens_on_the_kernel(
    tiny_engine_factory: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, hot_set: dict
) -> None:
    """Learned tables on the kernel, every table on it (the backend the start-up timing may
    choose) and the stacked delta alone serve the same tokens, on steps with learned routes
    and on steps of adapters and a mix alone."""
    calls = count_calls(monkeypatch, GroupedDelta, "__call__")
    for routes in (LEARNED, STATIC):
        served, learned_calls = _serve(
            tiny_engine_factory, True, False, calls, routes, hot_set=hot_set
        )
        everything, all_calls = _serve(
            tiny_engine_factory, True, True, calls, routes, hot_set=hot_set
        )
        stacked, none = _serve(tiny_engine_factory, False, False, calls, routes, hot_set=hot_set)
        assert none == 0, "the stacked backend called the kernel"
        assert all_calls > 0, "the grouped kernel never ran"
        assert (learned_calls > 0) == (routes is LEARNED), "static steps took the kernel"
        assert_same_generations(served, stacked, tolerance=1e-4)
        assert_same_generations(everything, stacked, tolerance=1e-4)


def _logits(factory: Callable[..., Any], dtype: str, grouped: bool, route: Any) -> torch.Tensor:
    engine = factory(dtype=dtype, hot_set={"num_slots": 3})
    # learned tables on the kernel, or all on the packed stacked delta (whatever the start-up
    # timing chose: the comparison is between these two)
    engine.hot_set.backend = PackedLoRA(GroupedDeltas() if grouped else None)
    prompt = random_prompts(1, 256, [24], seed=3)[0]
    return engine_prefill_logits(engine, route, prompt).float()


@pytest.mark.parametrize("top_k", [1, 2])
def test_bf16_logits_stay_as_close_to_fp32_on_the_kernel(
    tiny_engine_factory: Callable[..., Any], top_k: int
) -> None:
    route = LearnedRoute(composition="moe", top_k=top_k)
    exact = _logits(tiny_engine_factory, "float32", True, route)
    kernel = _logits(tiny_engine_factory, "bfloat16", True, route)
    stacked = _logits(tiny_engine_factory, "bfloat16", False, route)
    torch.testing.assert_close(kernel, stacked, atol=0.05, rtol=0.02)
    assert (kernel - exact).abs().mean() <= (stacked - exact).abs().mean() * 1.1
