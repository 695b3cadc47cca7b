"""Gate telemetry through the real engine on a tiny composition whose gate is known exactly.

With a zero gate weight, every token of a layer gets that layer's bias as its logits, so the
routing entropy, the top-1 expert and the top-1 weight of each layer are known in closed form.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kernels import cpu_topk_route
from molora_runtime.lora.composition import load_composition
from molora_runtime.model.learned_gate import ENTROPY_BUCKETS, TOP1_BUCKETS
from molora_runtime.model.lora_context import LoRAContext
from molora_runtime.routes import LearnedRoute
from tests.molora_runtime.rt_util import (
    make_composition,
    random_prompts,
    request,
    run_to_completion,
)

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def flat_gate(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_composition(
        tiny_llama,
        tmp_path_factory.mktemp("flat") / "flat",
        ["a", "b", "c"],
        top_k=2,
        temperature=TEMPERATURE,
        seed=9,
        gate_scale=0.0,
    )


def expected(bias: torch.Tensor, top_k: int) -> tuple[float, float, int]:
    """(normalized entropy, top-1 weight, top-1 expert) of logits `bias` [K]."""
    p = torch.softmax(bias.double() / TEMPERATURE, -1)
    entropy = float(-(p * p.log()).sum() / math.log(len(p)))
    top = torch.topk(bias.double() / TEMPERATURE, top_k).values
    return entropy, float(torch.softmax(top, -1)[0]), int(bias.argmax())


@pytest.mark.parametrize("top_k", [2, 1])
@pytest.mark.parametrize("static", [True, False], ids=["with-static", "learned-only"])
def test_values_on_a_known_gate(
    top_k: int, static: bool, tiny_engine_factory, tiny_adapters, flat_gate: Path, monkeypatch
) -> None:
    """The route kernel folds the statistics on CPU where it builds (the recorded tables'
    twin elsewhere), with or without a static request in every step: its tokens never count."""
    engine = tiny_engine_factory(compositions={"flat": flat_gate})
    prompts = random_prompts(2, 256, [5, 9], seed=3)
    new_tokens = 4
    route = LearnedRoute(composition="flat", top_k=top_k)
    reqs = [request(f"r{i}", p, route, new_tokens) for i, p in enumerate(prompts)]
    if static:
        reqs.append(request("static", prompts[0], "a", new_tokens))  # shares steps, not counted
    folded = []  # per recorded step: whether the route kernel's statistics were there
    routed_stats = LoRAContext.routed_stats
    monkeypatch.setattr(
        LoRAContext, "routed_stats", lambda ctx: folded.append(routed_stats(ctx)) or folded[-1]
    )
    run_to_completion(engine, reqs)
    kernel = cpu_topk_route.available()
    assert folded and all((got is not None) == kernel for got in folded)
    fed = sum(len(p) for p in prompts) + len(prompts) * (new_tokens - 1)  # the last is not fed
    telemetry, counts = engine.pop_gate_telemetry(), engine.pop_gate_stats()
    assert set(telemetry) == {"flat"}
    layers = telemetry["flat"]
    bias = load_composition("flat", flat_gate).gate_bias
    assert bias is not None and len(layers) == engine.arch.num_layers == bias.shape[0]
    for layer, got, picked in zip(bias, layers, counts["flat"], strict=True):
        entropy, top1_w, top1_e = expected(layer, top_k)
        top = set(torch.topk(layer, top_k).indices.tolist())
        assert picked == [fed if k in top else 0 for k in range(3)]
        assert got.tokens == fed
        assert got.entropy_sum == pytest.approx(fed * entropy, rel=1e-4)
        assert got.top1_weight_sum == pytest.approx(fed * top1_w, rel=1e-4)
        assert got.top1_expert == [fed if k == top1_e else 0 for k in range(3)]
        assert got.entropy_buckets == [fed if entropy <= b + 1e-6 else 0 for b in ENTROPY_BUCKETS]
        assert got.top1_weight_buckets == [fed if top1_w <= b + 1e-6 else 0 for b in TOP1_BUCKETS]
        if top_k == 1:
            assert got.top1_weight_buckets == [0] * (len(TOP1_BUCKETS) - 1) + [fed]
    assert engine.pop_gate_telemetry() == {}  # read once, then reset
