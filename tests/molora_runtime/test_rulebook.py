"""One rulebook (adapter_store.rules): every adapter the runtime loader refuses, the store's push
refuses first, with the same words; and an adapter declaring another base model is refused at
load time unless the server opts in."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from adapter_store import InvalidInputError
from adapter_store.base_model import base_identity, check_declared_base
from adapter_store.errors import RuleError
from adapter_store.validate import validate_adapter
from molora_runtime.errors import AdapterLoadError
from molora_runtime.lora.peft_adapter import read_peft_adapter
from tests.molora_runtime.rt_util import request, run_to_completion

WEIGHTS = "adapter_model.safetensors"
Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
DOWN_B = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"


def _config(**changes: object) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        path = folder / "adapter_config.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | changes))

    return edit


def _tensor(key: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        tensors = load_file(str(folder / WEIGHTS))
        tensors[key] = fn(tensors[key].clone())
        save_file(tensors, str(folder / WEIGHTS))

    return edit


CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "bias-all": (_config(bias="all"), "trained biases (bias='all')"),
    "fan-in-fan-out": (_config(fan_in_fan_out=True), "fan_in_fan_out (Conv1D)"),
    "dora": (_config(use_dora=True), "DoRA"),
    "modules-to-save": (_config(modules_to_save=["lm_head"]), "modules_to_save"),
    "not-lora": (_config(peft_type="IA3"), "peft_type must be LORA"),
    "nan": (_tensor(DOWN_B, lambda t: t.fill_(float("nan"))), "holds NaN or Inf values"),
    "wrong-shape": (_tensor(Q_A, lambda t: torch.cat([t, t[:, :1]], dim=1)), "(4, 65)"),
    "rank": (_tensor(Q_A, lambda t: t[:3]), "disagree with rank r=4"),
    "int": (_tensor(Q_A, lambda t: t.to(torch.int32)), "non-float dtype"),
}


@pytest.fixture(scope="module")
def broken(tiny_adapters: dict[str, Path], tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rulebook")
    out = {}
    for name, (mutate, _) in CASES.items():
        out[name] = Path(shutil.copytree(tiny_adapters["a"], root / name))
        mutate(out[name])
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_push_refuses_what_the_runtime_refuses(case, broken, tiny_engine_factory) -> None:
    fragment = CASES[case][1]
    with pytest.raises(InvalidInputError) as pushed:
        validate_adapter(broken[case])  # no --base-config: the rules alone must catch it
    engine = tiny_engine_factory()
    with pytest.raises(AdapterLoadError) as loaded:
        read_peft_adapter(case, broken[case], engine.arch, engine.hot_set.config.target_modules, 16)
    assert fragment in str(pushed.value), str(pushed.value)
    assert fragment in str(loaded.value), str(loaded.value)
    assert str(loaded.value).startswith(f"adapter {case!r}: ")


@pytest.fixture(scope="module")
def foreign(tiny_adapters: dict[str, Path], tmp_path_factory) -> Path:
    """Adapter `a` (its shapes fit) declaring it was trained on Qwen/Qwen3-8B."""
    folder = Path(shutil.copytree(tiny_adapters["a"], tmp_path_factory.mktemp("qwen") / "q"))
    _config(base_model_name_or_path="Qwen/Qwen3-8B")(folder)
    return folder


def test_declared_base_mismatch_is_refused(tiny_engine_factory, tiny_adapters, foreign) -> None:
    engine = tiny_engine_factory(adapters={**tiny_adapters, "qwen": foreign})
    got = run_to_completion(engine, [request("x", [1, 2, 3], "qwen", 4), request("y", [4], "a", 4)])
    assert got["x"]["finish_reason"] == "error"
    message = got["x"]["error"]
    assert "'qwen'" in message and "Qwen/Qwen3-8B" in message and "base-model mismatch" in message
    assert "allow_base_mismatch" in message
    assert got["y"]["finish_reason"] == "length" and got["y"]["error"] is None


def test_base_mismatch_override(tiny_engine_factory, tiny_adapters, foreign) -> None:
    engine = tiny_engine_factory(
        adapters={**tiny_adapters, "qwen": foreign}, hot_set={"allow_base_mismatch": True}
    )
    got = run_to_completion(engine, [request("x", [1, 2, 3], "qwen", 4)])
    assert got["x"]["finish_reason"] == "length"


def test_identity_decides_when_recorded(tiny_llama: Path) -> None:
    cfg = json.loads((tiny_llama / "config.json").read_text())
    mine = base_identity(cfg)
    check_declared_base("anything", mine, ["served"], mine)  # identity equal: names don't matter
    with pytest.raises(RuleError, match="base-model mismatch"):
        check_declared_base("served", base_identity(cfg | {"vocab_size": 7}), ["served"], mine)
    check_declared_base("/some/local/folder", None, ["served"], mine)  # cannot be checked
    check_declared_base(
        "HuggingFaceTB/SmolLM2-135M-Instruct", None, ["smollm2-135m-instruct"], mine
    )
