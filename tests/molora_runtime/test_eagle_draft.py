"""The learned draft (`eagle`): greedy outputs equal plain decoding on every route kind whatever the
head proposes (an untrained head, a trained one, a per-adapter one); a head trained on the tiny
model's own outputs is accepted more often than an untrained one; a head that is missing or of
other shapes is refused with an error naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from molora_runtime.config import SpeculativeConfig
from molora_runtime.engine.speculation.draft_head import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    DraftHead,
    DraftHeadConfig,
    DraftHeadError,
)
from molora_runtime.model.loader import load_model
from molora_runtime.routes import SingleRoute
from molora_runtime.training.draft import DraftTrainConfig, train_draft
from tests.molora_runtime.rt_util import random_prompts, request, run_to_completion
from tests.molora_runtime.test_speculative_decoding import MIX, ROUTES, route_kind

SPEC = {"method": "eagle", "num_speculative_tokens": 4, "max_batch": 8}
TRAIN = dict(sequences=96, max_tokens=40, window=5, steps=400, batch_size=16, lr=3e-3)


def prompts(n: int, seed: int) -> list[list[int]]:
    return random_prompts(n, 256, [10 + (i % 5) for i in range(n)], seed=seed)


@pytest.fixture(scope="module")
def heads(tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path_factory) -> dict[str, str]:
    """`untrained`: a new head (the target's last layer, random fc); `trained`: trained on the
    base model's greedy answers; `a`: that head tuned on adapter a's answers."""
    root = tmp_path_factory.mktemp("heads")
    lm = load_model(tiny_llama)
    DraftHead.from_target(lm, DraftHeadConfig.for_arch(lm.arch), seed=3).save(root / "untrained")
    train_prompts = prompts(96, seed=100)
    base = DraftTrainConfig(model=str(tiny_llama), output=str(root / "trained"), **TRAIN)
    train_draft(base, train_prompts)
    tuned = base.model_copy(update={
        "output": str(root / "a"), "adapter": f"a={tiny_adapters['a']}",
        "init_from": str(root / "trained"), "steps": 100,
    })  # fmt: skip
    train_draft(tuned, train_prompts)
    return {name: str(root / name) for name in ("untrained", "trained", "a")}


def acceptance(engine) -> float:
    total = engine.drafter.counters.total
    return total.accepted / max(total.draft_tokens, 1)


@pytest.mark.parametrize("route", ROUTES, ids=["base", "single", "mix", "vocab", "learned"])
@pytest.mark.parametrize("head", ["untrained", "trained"])
def test_greedy_outputs_equal_plain_decoding(tiny_engine_factory, heads, route, head) -> None:
    ps = prompts(3, seed=11)

    def reqs():
        return [request(f"r{i}", p, route, 30) for i, p in enumerate(ps)]

    plain = run_to_completion(tiny_engine_factory(max_num_seqs=4), reqs())
    engine = tiny_engine_factory(speculative={**SPEC, "model": heads[head]}, max_num_seqs=4)
    spec = run_to_completion(engine, reqs())
    for rid in plain:
        assert spec[rid]["tokens"] == plain[rid]["tokens"], rid
    counters = engine.drafter.counters
    assert counters.total.drafts > 0
    assert counters.by_route[route_kind(route)].drafts == counters.total.drafts
    assert engine.block_manager.num_used == 0


def test_a_trained_head_is_accepted_more_than_an_untrained_one(tiny_engine_factory, heads):
    """Held-out prompts on the base route: the head trained on the target's outputs agrees
    with it far more often than one that never saw them."""

    def reqs():
        return [request(f"r{i}", p, None, 40) for i, p in enumerate(prompts(6, seed=7))]

    rates = {}
    for head in ("untrained", "trained"):
        engine = tiny_engine_factory(speculative={**SPEC, "model": heads[head]}, max_num_seqs=6)
        run_to_completion(engine, reqs())
        rates[head] = acceptance(engine)
    assert rates["trained"] > rates["untrained"] + 0.08, rates
    assert rates["trained"] > 0.1, rates


def test_a_per_adapter_head_drafts_for_its_adapter_only(tiny_engine_factory, heads) -> None:
    spec = {**SPEC, "model": heads["trained"], "draft_heads": {"a": heads["a"]}}
    ps = prompts(4, seed=21)
    routes = ["a", "b", None, MIX]

    def reqs():
        return [request(f"r{i}", p, r, 30) for i, (p, r) in enumerate(zip(ps, routes, strict=True))]

    plain = run_to_completion(tiny_engine_factory(max_num_seqs=4), reqs())
    engine = tiny_engine_factory(speculative=spec, max_num_seqs=4)
    assert {k: v["tokens"] for k, v in run_to_completion(engine, reqs()).items()} == {
        k: v["tokens"] for k, v in plain.items()
    }
    drafter = engine.drafter
    for ref in ("a", "a@v1"):  # a versioned reference drafts with its adapter's head
        assert drafter.new_state(None, SingleRoute(adapter=ref)).head is drafter.adapter_heads["a"]
    assert drafter.new_state(None, SingleRoute(adapter="b")).head is drafter.shared_head
    assert drafter.counters.by_name["a"].drafts > 0 and drafter.counters.by_name["b"].drafts > 0


def test_the_config_refuses_a_missing_head(tmp_path: Path, heads) -> None:
    with pytest.raises(ValueError, match="needs 'model'"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ValueError, match=r"model: .* holds no draft_head\.safetensors"):
        SpeculativeConfig(method="eagle", model=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match=r"draft_heads\.a: .* holds no draft_head"):
        SpeculativeConfig(method="eagle", model=heads["trained"], draft_heads={"a": str(tmp_path)})
    with pytest.raises(ValueError, match="need method 'eagle'"):
        SpeculativeConfig(method="ngram", model=heads["trained"])
    with pytest.raises(ValueError, match="need method 'eagle'"):
        SpeculativeConfig(method="suffix", draft_heads={"a": heads["trained"]})


def test_a_head_of_other_shapes_is_refused_at_start(tiny_engine_factory, heads, tmp_path) -> None:
    wide = tmp_path / "wide"
    wide.mkdir()
    config = json.loads((Path(heads["trained"]) / CONFIG_FILE).read_text())
    (wide / CONFIG_FILE).write_text(
        json.dumps({**config, "hidden_size": config["hidden_size"] * 2})
    )
    (wide / WEIGHTS_FILE).write_bytes((Path(heads["trained"]) / WEIGHTS_FILE).read_bytes())
    with pytest.raises(DraftHeadError, match="does not fit the model: hidden_size"):
        tiny_engine_factory(speculative={**SPEC, "model": str(wide)})

    bent = tmp_path / "bent"
    bent.mkdir()
    (bent / CONFIG_FILE).write_text(json.dumps(config))
    tensors = load_file(str(Path(heads["trained"]) / WEIGHTS_FILE))
    tensors["fc.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(bent / WEIGHTS_FILE))
    with pytest.raises(DraftHeadError, match=r"tensor fc.weight has shape \(3, 3\)"):
        tiny_engine_factory(
            speculative={**SPEC, "model": heads["a"], "draft_heads": {"a": str(bent)}}
        )

    (bent / WEIGHTS_FILE).write_bytes(b"not safetensors")
    with pytest.raises(DraftHeadError, match=r"cannot read draft_head\.safetensors"):
        tiny_engine_factory(speculative={**SPEC, "model": str(bent)})
