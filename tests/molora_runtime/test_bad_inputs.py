"""Bad inputs each give a clear error naming the adapter and the tensor, and nothing else in the
batch is disturbed (good requests' tokens equal a clean run)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from molora_runtime.errors import AdapterLoadError, InvalidRequestError
from molora_runtime.lora.source import AdapterNotFoundError
from molora_runtime.model.tiny import make_tiny_model
from molora_runtime.routes import LearnedRoute, MixRoute
from tests.molora_runtime.rt_util import (
    GOOD_ROUTES,
    make_peft_adapter,
    random_prompts,
    request,
    run_to_completion,
)

WEIGHTS = "adapter_model.safetensors"
Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
DOWN_B = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit(folder: Path, key: str, fn) -> None:
    tensors = load_file(str(folder / WEIGHTS))
    assert key in tensors, sorted(tensors)[:4]
    tensors[key] = fn(tensors[key].clone())
    save_file(tensors, str(folder / WEIGHTS))


@pytest.fixture(scope="module")
def bad(tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad-adapters")
    wide_model = make_tiny_model(root / "wide-model", hidden_size=32)
    deep_model = make_tiny_model(root / "deep-model", num_layers=3)
    out = {
        "wide": make_peft_adapter(wide_model, root / "wide", r=4, alpha=8, seed=1),
        "deep": make_peft_adapter(deep_model, root / "deep", r=4, alpha=8, seed=1),
        "big-rank": make_peft_adapter(tiny_llama, root / "big-rank", r=20, alpha=8, seed=1),
        "lm-head": make_peft_adapter(
            tiny_llama, root / "lm-head", r=4, alpha=8, seed=1, target_modules=["q_proj", "lm_head"]
        ),
        "embed": make_peft_adapter(
            tiny_llama,
            root / "embed",
            r=4,
            alpha=8,
            seed=1,
            target_modules=["q_proj", "embed_tokens"],
        ),
        "dora": make_peft_adapter(tiny_llama, root / "dora", r=4, alpha=8, seed=1, use_dora=True),
    }
    a = tiny_adapters["a"]
    out["bad-shape"] = _copy(a, root / "bad-shape")
    _edit(out["bad-shape"], Q_A, lambda t: torch.cat([t, t[:, :1]], dim=1))
    out["nan"] = _copy(a, root / "nan")
    _edit(out["nan"], DOWN_B, lambda t: t.index_fill_(0, torch.tensor([3]), float("nan")))
    out["inf"] = _copy(a, root / "inf")
    _edit(out["inf"], Q_A, lambda t: t.index_fill_(1, torch.tensor([0]), float("inf")))
    out["no-config"] = _copy(a, root / "no-config")
    (out["no-config"] / "adapter_config.json").unlink()
    out["no-weights"] = _copy(a, root / "no-weights")
    (out["no-weights"] / WEIGHTS).unlink()
    out["gone"] = root / "does-not-exist"
    out["pickle"] = _copy(a, root / "pickle")
    torch.save(load_file(str(a / WEIGHTS)), out["pickle"] / "adapter_model.bin")
    (out["pickle"] / WEIGHTS).unlink()
    out["late"] = _copy(a, root / "late")  # becomes corrupt after validation
    return out


# name → fragments the error must contain (besides the adapter's name)
CASES = {
    "wide": ["lora_A.weight", "base-model mismatch"],
    "deep": ["layers.2.", "layer 2", "base-model mismatch"],
    "big-rank": ["lora_A.weight", "rank 20", "max_rank=16"],
    "lm-head": ["base_model.model.lm_head.", "does not serve"],
    "embed": ["embed_tokens", "does not serve"],
    "dora": ["DoRA"],
    "bad-shape": [Q_A, "(4, 65)"],
    "nan": [DOWN_B, "NaN or Inf"],
    "inf": [Q_A, "NaN or Inf"],
    "no-config": ["missing file adapter_config.json"],
    "no-weights": ["missing file adapter_model.safetensors"],
    "gone": ["does not exist"],
    "pickle": ["adapter_model.bin", "pickle"],
}

GOOD = GOOD_ROUTES


@pytest.fixture(scope="module")
def engine_factory(tiny_engine_factory, tiny_adapters, bad):
    def factory(**kw):
        return tiny_engine_factory(adapters={**tiny_adapters, **bad}, **kw)

    return factory


@pytest.fixture(scope="module")
def clean(engine_factory) -> dict[str, list[int]]:
    prompts = random_prompts(len(GOOD), 256, [7, 12, 9, 15], seed=99)
    reqs = [request(rid, p, r, 10) for (rid, r), p in zip(GOOD.items(), prompts, strict=True)]
    got = run_to_completion(engine_factory(), reqs)
    return {rid: got[rid]["tokens"] for rid in GOOD}


def _run_with_bad(engine, bad_req, prompt_ids=None, before_add=None):
    prompts = random_prompts(len(GOOD), 256, [7, 12, 9, 15], seed=99)
    good = [request(rid, p, r, 10) for (rid, r), p in zip(GOOD.items(), prompts, strict=True)]
    results: dict[str, dict] = {}
    for req in good:
        engine.add_request(req)
    step = 0
    while engine.has_work():
        if step == 3:  # mid-decode of the good ones
            if before_add is not None:
                before_add()
            engine.add_request(bad_req, prompt_ids)
        for out in engine.step():
            res = results.setdefault(out.request_id, {"tokens": []})
            res["tokens"] += out.new_token_ids
            if out.finished:
                res.update(reason=out.finish_reason, error=out.error)
        step += 1
    return results


def _assert_undisturbed(engine, results, clean) -> None:
    for rid in GOOD:
        assert results[rid]["tokens"] == clean[rid], rid
        assert results[rid]["reason"] == "length"
    assert engine.block_manager.num_free == engine.block_manager.num_blocks
    assert not engine.hot_set.in_use()


@pytest.mark.parametrize("name", list(CASES))
def test_bad_adapter_fails_alone_with_a_clear_error(name: str, engine_factory, bad) -> None:
    from molora_runtime.lora.peft_adapter import read_peft_adapter

    engine = engine_factory()
    with pytest.raises(AdapterLoadError) as info:
        read_peft_adapter(name, bad[name], engine.arch, engine.hot_set.config.target_modules, 16)
    message = str(info.value)
    assert repr(name) in message
    for fragment in CASES[name]:
        assert fragment in message, message


@pytest.mark.parametrize("name", list(CASES))
def test_bad_adapter_mid_run_leaves_the_batch_alone(name: str, engine_factory, clean) -> None:
    engine = engine_factory()
    bad_req = request("bad", [1, 2, 3, 4], name, 10)
    results = _run_with_bad(engine, bad_req)
    assert results["bad"]["reason"] == "error"
    assert results["bad"]["tokens"] == []
    assert repr(name) in results["bad"]["error"]
    for fragment in CASES[name]:
        assert fragment in results["bad"]["error"]
    _assert_undisturbed(engine, results, clean)
    assert name not in engine.hot_set.loaded()


def test_bad_adapter_inside_a_mix(engine_factory, clean) -> None:
    engine = engine_factory()
    bad_req = request("bad", [5, 6, 7], MixRoute(weights={"a": 0.5, "nan": 0.5}), 10)
    results = _run_with_bad(engine, bad_req)
    assert results["bad"]["reason"] == "error" and DOWN_B in results["bad"]["error"]
    _assert_undisturbed(engine, results, clean)


def test_folder_corrupted_after_validation(engine_factory, bad, clean) -> None:
    engine = engine_factory()
    bad_req = request("bad", [5, 6, 7], "late", 10)
    ids = engine.validate_request(bad_req)  # fine at this point

    def corrupt() -> None:
        (bad["late"] / WEIGHTS).write_bytes(b"\x00garbage" * 10)

    results = _run_with_bad(engine, bad_req, ids, before_add=corrupt)
    error = results["bad"]["error"]
    assert results["bad"]["reason"] == "error"
    assert "'late'" in error and WEIGHTS in error
    _assert_undisturbed(engine, results, clean)


def test_targets_outside_the_hot_set(tiny_engine_factory) -> None:
    engine = tiny_engine_factory(hot_set={"target_modules": ["q_proj", "v_proj"]})
    results = run_to_completion(engine, [request("x", [1, 2, 3], "a", 4)])
    error = results["x"]["error"]
    assert results["x"]["finish_reason"] == "error"
    assert "'a'" in error and "lora_A.weight" in error and "hot_set.target_modules" in error


# ----- request-level refusals: raised by validate_request and add_request ---------------------


def test_unknown_adapter_and_composition(engine_factory) -> None:
    engine = engine_factory()
    for route in ("nope", MixRoute(weights={"a": 0.5, "nope": 0.5}), {"kind": "vocab", "ranges": [
        {"start": 0, "end": 9, "adapter": "nope"}]}):  # fmt: skip
        req = request("x", [1, 2], route, 4)
        with pytest.raises(AdapterNotFoundError, match="nope"):
            engine.validate_request(req)
        with pytest.raises(AdapterNotFoundError, match="nope"):
            engine.add_request(req)
    with pytest.raises(AdapterNotFoundError, match="ghost"):
        engine.add_request(request("x", [1, 2], LearnedRoute(composition="ghost"), 4))
    assert not engine.has_work()


def test_prompt_too_long_names_the_limit(engine_factory) -> None:
    engine = engine_factory(max_model_len=64)
    with pytest.raises(InvalidRequestError, match="64") as info:
        engine.add_request(request("x", list(range(64)), "a", 4))
    assert "64 tokens" in str(info.value)
    engine.validate_request(request("x", list(range(63)), "a", 4))  # one below is fine


@pytest.mark.parametrize("ids", [[1, -1, 3], [1, 256], [10**9]])
def test_invalid_token_ids(ids, engine_factory) -> None:
    engine = engine_factory()
    with pytest.raises(InvalidRequestError, match=r"outside the vocabulary \[0, 256\)"):
        engine.add_request(request("x", ids, None, 4))
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request(request("x", [], None, 4))


def test_mix_wider_than_table(engine_factory) -> None:
    engine = engine_factory(hot_set={"max_adapters_per_token": 2})
    with pytest.raises(InvalidRequestError, match="max_adapters_per_token=2"):
        engine.add_request(request("x", [1, 2], MixRoute(weights={"a": 1, "b": 1, "c": 1}), 4))
    with pytest.raises(InvalidRequestError, match="max_adapters_per_token=2"):
        engine.add_request(request("x", [1, 2], LearnedRoute(composition="moe", top_k=3), 4))
    assert not engine.has_work()
