"""Push-time validation of adapter and composition folders; nothing is uploaded unless it passes.

The rules themselves live in `adapter_store.rules`, the rulebook the runtime's loader applies
too, so a bad adapter fails here, on the publisher's machine, and not on every replica later.
This module adds the packaging rules of a store version (allowed files, size limit) and reads
the files without torch (safetensors header, numpy for values).
"""

from __future__ import annotations

import hashlib
import json
import stat
from pathlib import Path
from typing import Any, BinaryIO

from pydantic import BaseModel

from adapter_store import base_model, composition_spec, peft_config, rules
from adapter_store.composition_spec import COMPOSITION_CONFIG, GATES_FILE, CompositionSpec
from adapter_store.errors import InvalidInputError, RuleError
from adapter_store.layout import MANIFEST
from adapter_store.limits import MAX_CONFIG_BYTES, MAX_CONFIG_DEPTH, json_depth
from adapter_store.peft_config import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PICKLE_SUFFIXES
from adapter_store.safetensors_header import (
    max_abs_values_from,
    nonfinite_tensors,
    read_header,
    read_header_from,
)

README = "README.md"
DEFAULT_MAX_BYTES = 2 * 1024**3
# Base-config keys that do not change any weight shape (dropped before fingerprinting).
VOLATILE_CONFIG_KEYS = {"transformers_version", "torch_dtype", "dtype", "_name_or_path"}


class AdapterInfo(BaseModel):
    """What validation learned about an adapter folder (becomes part of its manifest)."""

    files: list[Path]
    base_model: str | None
    base_model_fingerprint: str | None
    base_model_identity: str | None = None
    rank: int
    alpha: float
    target_modules: list[str]
    num_layers: int
    dtype: str


def sha256_file(path: Path, chunk: int = 4 * 1024 * 1024) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _check_files(
    folder: Path, required: list[str], optional: list[str], max_bytes: int
) -> list[Path]:
    if not folder.is_dir():
        raise InvalidInputError(f"{folder} is not a directory")
    allowed = set(required) | set(optional)
    files: list[Path] = []
    total = 0
    for path in sorted(folder.iterdir()):
        if path.name.startswith("."):
            continue  # editor / OS droppings are not part of the adapter
        _refuse_links(path)
        if path.name == MANIFEST:
            continue  # a pulled folder's record of its version: a push writes its own
        if path.suffix.lower() in PICKLE_SUFFIXES:
            raise InvalidInputError(
                f"{path.name}: pickle-based weights are refused; save with "
                "safe_serialization=True (safetensors)"
            )
        if path.name not in allowed or not path.is_file():
            raise InvalidInputError(
                f"unexpected entry {path.name!r} in {folder}; allowed files: {sorted(allowed)}"
            )
        total += path.stat().st_size
        files.append(path)
    missing = [name for name in required if not (folder / name).is_file()]
    if missing:
        raise InvalidInputError(f"{folder} lacks required file(s): {', '.join(missing)}")
    if total > max_bytes:
        raise InvalidInputError(f"{folder} holds {total} bytes, over the {max_bytes}-byte limit")
    return files


def _refuse_links(path: Path) -> None:
    """A symlink or a file with other hard links may name someone else's data: refused."""
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode):
        raise InvalidInputError(f"{path.name} is a symbolic link; links are refused, copy the file")
    if stat.S_ISREG(info.st_mode) and info.st_nlink > 1:
        raise InvalidInputError(
            f"{path.name} has {info.st_nlink} hard links; linked files are refused, copy the file"
        )


def load_base_config(path: Path) -> dict[str, Any]:
    """Read a HF config.json (or the one inside a model folder)."""
    cfg_path = path / "config.json" if path.is_dir() else path
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidInputError(f"cannot read base model config {cfg_path}: {exc}") from exc
    if not isinstance(cfg, dict):
        raise InvalidInputError(f"base model config {cfg_path} is not a JSON object")
    return cfg


def config_fingerprint(cfg: dict[str, Any]) -> str:
    stable = {k: v for k, v in cfg.items() if k not in VOLATILE_CONFIG_KEYS}
    return hashlib.sha256(
        json.dumps(stable, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()


def validate_adapter(
    folder: Path, base_config: dict[str, Any] | None = None, max_bytes: int = DEFAULT_MAX_BYTES
) -> AdapterInfo:
    """Check a PEFT LoRA folder against the rulebook; every failure is an InvalidInputError
    saying what and where."""
    folder = Path(folder)
    files = _check_files(folder, [ADAPTER_CONFIG, ADAPTER_WEIGHTS], [README], max_bytes)
    weights = folder / ADAPTER_WEIGHTS
    with weights.open("rb") as fh:
        info = check_adapter_contents(
            (folder / ADAPTER_CONFIG).read_bytes(), fh, weights.stat().st_size, base_config
        )
    return info.model_copy(update={"files": files})


def check_adapter_contents(
    config: bytes, weights: BinaryIO, weights_size: int, base_config: dict[str, Any] | None = None
) -> AdapterInfo:
    """The rulebook over an adapter's `adapter_config.json` bytes and its weights file (open,
    or in memory), for a caller that has read the files once already; `files` is left empty."""
    try:
        cfg = peft_config.read_peft_config_text(config.decode())
        header = read_header_from(weights, ADAPTER_WEIGHTS, weights_size)
        entries = [rules.TensorEntry(k, t.dtype, tuple(t.shape)) for k, t in header.items()]
        base = base_model.base_shapes(base_config) if base_config is not None else None
        plan = rules.check_adapter(cfg, entries, base)
    except (RuleError, UnicodeDecodeError) as exc:
        raise InvalidInputError(str(exc)) from exc
    peaks = max_abs_values_from(weights, ADAPTER_WEIGHTS, weights_size, header)
    try:
        for key_a, key_b, _, scale in plan.pairs.values():
            rules.check_values(key_a, peaks[key_a])
            rules.check_values(key_b, peaks[key_b], scale)
    except RuleError as exc:
        raise InvalidInputError(f"{ADAPTER_WEIGHTS}: {exc}") from None
    return AdapterInfo(
        files=[],
        base_model=cfg.base_model_name_or_path,
        base_model_fingerprint=config_fingerprint(base_config) if base_config is not None else None,
        base_model_identity=base_model.base_identity(base_config)
        if base_config is not None
        else None,
        rank=cfg.r,
        alpha=cfg.lora_alpha,
        target_modules=plan.target_modules,
        num_layers=plan.num_layers,
        dtype=",".join(plan.dtypes),
    )


def read_composition(
    folder: Path, max_bytes: int = DEFAULT_MAX_BYTES
) -> tuple[list[Path], CompositionSpec]:
    """Check a composition folder (format, refs, gate shapes, finite values)."""
    folder = Path(folder)
    files = _check_files(folder, [COMPOSITION_CONFIG, GATES_FILE], [README], max_bytes)
    try:
        text = (folder / COMPOSITION_CONFIG).read_text()
        if len(text) > MAX_CONFIG_BYTES or json_depth(text) > MAX_CONFIG_DEPTH:
            raise ValueError(
                f"over {MAX_CONFIG_BYTES} bytes or nested deeper than {MAX_CONFIG_DEPTH} levels"
            )
        cfg = CompositionSpec.model_validate(json.loads(text))
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"invalid {COMPOSITION_CONFIG}: {exc}") from exc
    header = read_header(folder / GATES_FILE)
    expected = composition_spec.gate_shapes(cfg)
    extra = sorted(set(header) - set(expected))
    if extra or "gate.weight" not in header:
        raise InvalidInputError(
            f"{GATES_FILE} must hold 'gate.weight' (and optionally 'gate.bias'); found {sorted(header)}"
        )
    for tname, info in header.items():
        if info.dtype not in rules.FLOAT_DTYPES:
            raise InvalidInputError(f"{GATES_FILE}: {tname} has non-float dtype {info.dtype}")
        if info.shape != expected[tname]:
            raise InvalidInputError(
                f"{GATES_FILE}: {tname} has shape {info.shape}, expected {expected[tname]} "
                "(num_layers, K adapters, hidden_size)"
            )
    bad = nonfinite_tensors(folder / GATES_FILE)
    if bad:
        raise InvalidInputError(f"{GATES_FILE}: {bad[0]} holds NaN or Inf values")
    return files, cfg


def validate_stored(kind: str, folder: Path) -> None:
    """Re-check a stored version's files against the rulebook (what `verify` adds to checksums)."""
    if kind == "adapter":
        validate_adapter(folder)
    else:
        read_composition(folder)
