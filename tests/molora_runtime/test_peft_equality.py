"""Greedy fp32 tokens of a batch mixing three adapters and the base model equal
`PeftModel.generate(..., adapter_names=[...])` token for token (tiny random Llama and SmolLM2).

The adapters are made by `peft` itself with random A and B (`init_lora_weights=False`), different
ranks, all 7 target modules; one uses rsLoRA and one `rank_pattern`/`alpha_pattern`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from molora_runtime.engine.engine import LLMEngine
from tests.molora_runtime.rt_util import random_prompts, request, run_to_completion

BASE = "__base__"


def peft_tokens(pm, prompts: list[list[int]], names: list[str], max_new: int, eos: int | None):
    """PEFT greedy generation of equal-length prompts in ONE mixed-adapter batch."""
    assert len({len(p) for p in prompts}) == 1
    with torch.no_grad():
        out = pm.generate(
            torch.tensor(prompts),
            attention_mask=torch.ones(len(prompts), len(prompts[0]), dtype=torch.long),
            max_new_tokens=max_new,
            do_sample=False,
            adapter_names=names,
            pad_token_id=eos if eos is not None else 0,
        )
    result = []
    for row in out[:, len(prompts[0]) :].tolist():
        if eos is not None and eos in row:
            row = row[: row.index(eos) + 1]
        result.append(row)
    return result


def test_tiny_adapters_cover_the_required_options(tiny_adapters: dict[str, Path]) -> None:
    configs = {
        n: json.loads((p / "adapter_config.json").read_text()) for n, p in tiny_adapters.items()
    }
    assert len({c["r"] for c in configs.values()}) == 3
    for c in configs.values():
        assert sorted(c["target_modules"]) == sorted(
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        )
    assert configs["b"]["use_rslora"]
    assert configs["c"]["rank_pattern"] and configs["c"]["alpha_pattern"]


def test_tiny_mixed_batch_equals_peft(tiny_engine_factory, peft_abc) -> None:
    engine = tiny_engine_factory()
    routes = ["a", "b", "c", None, "c", "a", None, "b"]
    prompts = random_prompts(len(routes), 256, [9], seed=11)
    names = [r or BASE for r in routes]
    expected = peft_tokens(peft_abc, prompts, names, 12, None)
    got = run_to_completion(
        engine,
        [request(f"r{i}", p, r, 12) for i, (p, r) in enumerate(zip(prompts, routes, strict=True))],
    )
    for i in range(len(routes)):
        assert got[f"r{i}"]["tokens"] == expected[i], f"route {routes[i]}"
        assert got[f"r{i}"]["finish_reason"] == "length"
    # the adapters really change the output (otherwise the test would prove nothing)
    assert len({tuple(t) for t in expected[:4]}) == 4


def test_tiny_ragged_chunked_batch_equals_peft(tiny_engine_factory, peft_abc) -> None:
    """Different prompt lengths, prefill split over several steps (16-token budget) and decodes
    of earlier requests sharing steps with prefill chunks of later ones."""
    engine = tiny_engine_factory(max_num_batched_tokens=16, max_num_seqs=4)
    routes = ["a", None, "b", "c", "b", "a"]
    prompts = random_prompts(len(routes), 256, [5, 23, 13, 31, 7, 40], seed=12)
    got = run_to_completion(
        engine,
        [request(f"r{i}", p, r, 9) for i, (p, r) in enumerate(zip(prompts, routes, strict=True))],
    )
    for i, (p, r) in enumerate(zip(prompts, routes, strict=True)):
        assert got[f"r{i}"]["tokens"] == peft_tokens(peft_abc, [p], [r or BASE], 9, None)[0]


@pytest.mark.slow
def test_smollm2_mixed_batch_equals_peft(smollm2) -> None:
    tok = smollm2.engine.tokenizer
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, a small robot",
        "The three primary colors are",
    ]
    ids = [tok.encode(t, add_special_tokens=False) for t in texts]
    n = min(len(i) for i in ids)
    prompts = [i[:n] for i in ids]
    routes = ["s1", "s2", "s3", None]
    eos = 2
    expected = peft_tokens(smollm2.peft, prompts, [r or BASE for r in routes], 8, eos)
    got = run_to_completion(
        smollm2.engine,
        [
            request(f"smol{i}", p, r, 8)
            for i, (p, r) in enumerate(zip(prompts, routes, strict=True))
        ],
    )
    for i in range(4):
        assert got[f"smol{i}"]["tokens"] == expected[i], f"route {routes[i]}"
    assert len({tuple(t) for t in expected}) == 4


def test_regex_rank_and_alpha_patterns_equal_peft(tiny_llama: Path, tmp_path: Path) -> None:
    """PEFT matches pattern keys as whole regexes (`(.*\\.)?(key)$`), alternations included."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.molora_runtime.rt_util import build_engine, make_peft_adapter

    folder = make_peft_adapter(
        tiny_llama,
        tmp_path / "rx",
        r=8,
        alpha=8,
        seed=9,
        rank_pattern={"q_proj|v_proj": 2, r"layers\.1\.mlp\.(up|down)_proj": 5},
        alpha_pattern={"k_proj|o_proj": 30},
    )
    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    pm = PeftModel.from_pretrained(base, str(folder), adapter_name="rx").eval()
    prompt = random_prompts(1, 256, [10], seed=3)[0]
    got = run_to_completion(
        build_engine(tiny_llama, {"rx": folder}), [request("x", prompt, "rx", 8)]
    )
    assert got["x"]["error"] is None
    assert got["x"]["tokens"] == peft_tokens(pm, [prompt], ["rx"], 8, None)[0]


def _subset_engine_equals_peft(
    tiny_llama: Path, tiny_adapters: dict[str, Path], name: str, folder: Path, seed: int
) -> LLMEngine:
    """An engine serving `folder` as `name` beside the all-module adapter `a`, checked to give
    PEFT's tokens on `name`, `a` and the base model, mixed in one batch."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.molora_runtime.rt_util import build_engine

    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    pm = PeftModel.from_pretrained(base, str(folder), adapter_name=name)
    pm.load_adapter(str(tiny_adapters["a"]), adapter_name="a")
    pm.eval()
    engine = build_engine(tiny_llama, {name: folder, "a": tiny_adapters["a"]})
    routes = [name, "a", None, name]
    prompts = random_prompts(len(routes), 256, [8], seed=seed)
    expected = peft_tokens(pm, prompts, [r or BASE for r in routes], 10, None)
    got = run_to_completion(
        engine,
        [request(f"q{i}", p, r, 10) for i, (p, r) in enumerate(zip(prompts, routes, strict=True))],
    )
    for i, route in enumerate(routes):
        assert got[f"q{i}"]["tokens"] == expected[i], f"route {route}"
    assert expected[0] != peft_tokens(pm, [prompts[0]], [BASE], 10, None)[0]
    return engine


def test_layer_subset_adapter_equals_peft_and_skips_idle_layers(
    tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path: Path
) -> None:
    """An adapter trained on layer 1 only (`layers_to_transform`) beside one on every layer and
    the base model: PEFT's tokens, and a step touching only the first adds no delta on layer 0."""
    from molora_runtime.lora.routing import RouteSegment, build_lora_context
    from molora_runtime.routes import SingleRoute
    from tests.molora_runtime.rt_util import make_peft_adapter

    folder = make_peft_adapter(
        tiny_llama, tmp_path / "l1", r=4, alpha=8, seed=21, layers_to_transform=[1]
    )
    engine = _subset_engine_equals_peft(tiny_llama, tiny_adapters, "l1", folder, seed=21)

    hot_set = engine.hot_set
    alone = [RouteSegment(SingleRoute(adapter="l1"), torch.tensor([5, 6]))]
    ctx = build_lora_context(alone, hot_set, 2, torch.device("cpu"))
    assert ctx is not None and ctx.lora_layers == frozenset({1})
    y = torch.zeros(2, 4)
    assert ctx.add_lora(y, torch.ones(2, 4), object(), 0) is y  # layer 0: not even a backend call
    both = [*alone, RouteSegment(SingleRoute(adapter="a"), torch.tensor([7]))]
    ctx = build_lora_context(both, hot_set, 2, torch.device("cpu"))
    assert ctx is not None and ctx.lora_layers == frozenset({0, 1})


def test_module_subset_adapter_equals_peft_and_skips_untargeted_projections(
    tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path: Path
) -> None:
    """An adapter on q/v only beside one on every module: PEFT's tokens, and a step touching
    only the first makes no backend call for the projections it leaves alone (the MLP, o, k)."""
    from molora_runtime.lora.routing import RouteSegment, build_lora_context
    from molora_runtime.routes import SingleRoute
    from tests.molora_runtime.rt_util import make_peft_adapter

    folder = make_peft_adapter(
        tiny_llama, tmp_path / "qv", r=4, alpha=8, seed=23, target_modules=["q_proj", "v_proj"]
    )
    engine = _subset_engine_equals_peft(tiny_llama, tiny_adapters, "qv", folder, seed=23)

    qv_only = [RouteSegment(SingleRoute(adapter="qv"), torch.tensor([5, 6]))]
    ctx = build_lora_context(qv_only, engine.hot_set, 2, torch.device("cpu"))
    both = [*qv_only, RouteSegment(SingleRoute(adapter="a"), torch.tensor([7]))]
    wide = build_lora_context(both, engine.hot_set, 2, torch.device("cpu"))
    assert ctx is not None and ctx.lora_cells is not None
    assert wide is not None and wide.lora_cells is not None
    assert ctx.lora_cells < wide.lora_cells  # the q/v adapter's cells: a strict subset
    callers = [m.lora for m in [*engine.model.lora_linears(), *engine.model.fused_groups()]]
    called: list[int] = []

    class Counting:
        def add(self, y, x, buffers, layer, c):
            called.append(id(buffers))
            return y

    ctx.backend = Counting()
    for layer in range(engine.model.arch.num_layers):
        for buffers in {id(b): b for b in callers if b is not None}.values():
            ctx.add_lora(torch.zeros(2, 4), torch.ones(2, 4), buffers, layer)
    assert called and len(called) == len(ctx.lora_cells)
    assert len(ctx.lora_cells) < len(wide.lora_cells)
    # a slot cleared after its cells were asked for holds none (the step's union is not kept)
    slots = engine.hot_set.slots
    qv_slot = int(ctx.slot_ids[0, 0])
    assert slots.cells_of({qv_slot}) == ctx.lora_cells
    slots.clear(qv_slot)
    assert slots.cells_of({qv_slot}) == frozenset()
