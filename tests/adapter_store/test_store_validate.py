"""Push-time validation: every rejection names the problem and leaves nothing in the store."""

from __future__ import annotations

import json
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from adapter_store import InvalidInputError, Registry, open_registry
from adapter_store.base_model import base_identity
from adapter_store.manifest import FileEntry
from adapter_store.validate import sha256_file


def _edit_config(folder: Path, **changes: object) -> None:
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps(cfg | changes))


def _edit_tensors(folder: Path, fn: Callable[[dict], dict]) -> None:
    path = folder / "adapter_model.safetensors"
    save_file(fn(load_file(str(path))), str(path))


def _truncate(folder: Path) -> None:
    path = folder / "adapter_model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])


def _pickle_disguised(folder: Path) -> None:
    (folder / "adapter_model.safetensors").write_bytes(pickle.dumps({"x": 1}))


def _rank_mismatch(folder: Path) -> None:
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    _edit_tensors(folder, lambda t: t | {key: np.zeros((3, 64), dtype=np.float32)})


def _missing_b(folder: Path) -> None:
    key = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    _edit_tensors(folder, lambda t: {k: v for k, v in t.items() if k != key})


def _full_weight(folder: Path) -> None:
    _edit_tensors(
        folder, lambda t: t | {"base_model.model.lm_head.weight": np.zeros((4, 4), np.float32)}
    )


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def _nan(folder: Path) -> None:
    _edit_tensors(
        folder,
        lambda t: (
            t
            | {
                Q_A: np.where(
                    np.arange(t[Q_A].size).reshape(t[Q_A].shape) == 3, np.nan, t[Q_A]
                ).astype(np.float32)
            }
        ),
    )


def _inf(folder: Path) -> None:
    _edit_tensors(folder, lambda t: t | {Q_A: np.full_like(t[Q_A], np.inf)})


def _wrong_shape(folder: Path) -> None:
    """One layer's q_proj A reads 65 features, the others 64: no base config needed to see it."""
    _edit_tensors(folder, lambda t: t | {Q_A: np.zeros((t[Q_A].shape[0], 65), np.float32)})


def _int_dtype(folder: Path) -> None:
    _edit_tensors(folder, lambda t: t | {Q_A: t[Q_A].astype(np.int32)})


CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "pickle-bin": (lambda f: (f / "adapter_model.bin").write_bytes(b"\x80\x04"), "pickle-based weights are refused"),
    "pickle-disguised": (_pickle_disguised, "pickles are refused"),
    "no-weights": (lambda f: (f / "adapter_model.safetensors").unlink(), "lacks required file"),
    "stray-file": (lambda f: (f / "notes.txt").write_text("x"), "unexpected entry 'notes.txt'"),
    "bad-json": (lambda f: (f / "adapter_config.json").write_text("{"), "not a valid PEFT LoRA config"),
    "not-lora": (lambda f: _edit_config(f, peft_type="IA3"), "peft_type must be LORA"),
    "dora": (lambda f: _edit_config(f, use_dora=True), "DoRA"),
    "no-rank": (lambda f: _edit_config(f, r=None), "not a valid PEFT LoRA config"),
    "rank-mismatch": (_rank_mismatch, "disagree with rank r=4"),
    "missing-target": (lambda f: _edit_config(f, target_modules=["q_proj", "v_proj", "down_proj", "o_proj"]), r"\['o_proj'\] have no LoRA tensors"),
    "untargeted": (lambda f: _edit_config(f, target_modules=["q_proj", "v_proj"]), "'down_proj' is not in target_modules"),
    "missing-b": (_missing_b, "lacks lora_B"),
    "full-weight": (_full_weight, "is not a LoRA A/B weight"),
    "truncated": (_truncate, "bad header size|truncated or corrupted"),
    # the rulebook's refusals, shared with the runtime loader (tests/molora_runtime/test_bad_inputs.py)
    "fan-in-fan-out": (lambda f: _edit_config(f, fan_in_fan_out=True), r"fan_in_fan_out \(Conv1D\)"),
    "bias-all": (lambda f: _edit_config(f, bias="all"), "trained biases"),
    "lora-bias": (lambda f: _edit_config(f, lora_bias=True), "lora_bias"),
    "modules-to-save": (lambda f: _edit_config(f, modules_to_save=["lm_head"]), "modules_to_save"),
    "nan": (_nan, "holds NaN or Inf values"),
    "inf": (_inf, "holds NaN or Inf values"),
    "wrong-shape": (_wrong_shape, r"inconsistent shapes|shapes disagree"),
    "int-dtype": (_int_dtype, "non-float dtype"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_adapter_refused(registry: Registry, alpha: Path, case: str) -> None:
    mutate, message = CASES[case]
    mutate(alpha)
    with pytest.raises(InvalidInputError, match=message):
        registry.publish_adapter(alpha, "bad", "1")
    assert registry.backend.list_keys("") == []


def test_shapes_checked_against_base(registry: Registry, alpha: Path, base_config: dict) -> None:
    registry.publish_adapter(alpha, "fits", "1", base_config=base_config)
    wider = base_config | {"hidden_size": 128, "head_dim": 16}
    with pytest.raises(
        InvalidInputError,
        match=r"down_proj.lora_B.weight \(64, 4\): LoRA maps 128→64 but the base model's "
        r"down_proj is 128→128 \(base-model mismatch\)",
    ):
        registry.publish_adapter(alpha, "misfit", "1", base_config=wider)
    shallow = base_config | {"num_hidden_layers": 1}
    with pytest.raises(InvalidInputError, match="base model has only 1 layers"):
        registry.publish_adapter(alpha, "misfit", "1", base_config=shallow)
    assert registry.names("adapter") == ["fits"]


def test_size_limit(store_url: str, alpha: Path) -> None:
    small = open_registry(store_url, create=True, max_bytes=1000)
    with pytest.raises(InvalidInputError, match="over the 1000-byte limit"):
        small.publish_adapter(alpha, "big", "1")
    assert small.backend.list_keys("") == []


def test_missing_base_model_id(registry: Registry, alpha: Path, tmp_path: Path) -> None:
    folder = Path(shutil.copytree(alpha, tmp_path / "anon"))
    _edit_config(folder, base_model_name_or_path=None)
    with pytest.raises(InvalidInputError, match="pass --base-model"):
        registry.publish_adapter(folder, "anon", "1")
    assert (
        registry.publish_adapter(folder, "anon", "1", base_model="org/base").base_model
        == "org/base"
    )


def test_base_identity_recorded(registry: Registry, alpha: Path, base_config: dict) -> None:
    m = registry.publish_adapter(alpha, "ident", "1", base_config=base_config)
    assert m.base_model_identity == base_identity(base_config)
    assert registry.publish_adapter(alpha, "anon", "1").base_model_identity is None


def test_verify_applies_the_rulebook(registry: Registry, alpha: Path) -> None:
    """A version that breaks the rules (stored before they existed, or by hand) fails verify."""
    m = registry.publish_adapter(alpha, "ok", "1")
    assert registry.verify(m) == []
    key = next(k for k in registry.backend.list_keys("") if k.endswith("adapter_config.json"))
    local = registry.backend.local_path(key)
    if local is None:
        pytest.skip("needs a local backend to edit a stored file")
    cfg = json.loads(local.read_text())
    local.write_text(json.dumps(cfg | {"bias": "all"}))

    entries = [
        FileEntry(path=e.path, sha256=sha256_file(local), size=local.stat().st_size)
        if e.path == "adapter_config.json"
        else e
        for e in m.files
    ]
    problems = registry.verify(m.model_copy(update={"files": entries}))
    assert len(problems) == 1 and "breaks the rules" in problems[0] and "bias" in problems[0]


def test_header_length_that_starts_like_a_pickle_is_accepted(
    registry: Registry, alpha: Path
) -> None:
    """A header length whose low byte is 0x80 (the pickle PROTO opcode) is still safetensors."""
    path = alpha / "adapter_model.safetensors"
    tensors = load_file(str(path))
    for pad in range(256):
        save_file(tensors, str(path), metadata={"pad": "x" * pad})
        if path.read_bytes()[0] == 0x80:
            break
    assert path.read_bytes()[0] == 0x80
    registry.publish_adapter(alpha, "lucky", "1")
    assert registry.names("adapter") == ["lucky"]
