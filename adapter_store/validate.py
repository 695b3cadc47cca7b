"""Push-time validation of adapter and composition folders; nothing is uploaded unless it passes.

The checks mirror what the runtime will need to load the files (PEFT LoRA tensors with a
consistent rank, known targets, optional agreement with the base model's shapes), so a bad
adapter fails here, on the publisher's machine, and not on every replica later.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from adapter_store.errors import InvalidInputError
from adapter_store.names import parse_ref
from adapter_store.safetensors_header import FLOAT_DTYPES, read_float_tensor, read_header

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
README = "README.md"
COMPOSITION_CONFIG = "composition.json"
GATES_FILE = "gates.safetensors"
COMPOSITION_FORMAT = "molora-composition"
PICKLE_SUFFIXES = {".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt"}
DEFAULT_MAX_BYTES = 2 * 1024**3
LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")
# Base-config keys that do not change any weight shape (dropped before fingerprinting).
VOLATILE_CONFIG_KEYS = {"transformers_version", "torch_dtype", "dtype", "_name_or_path"}


class LoraConfigFile(BaseModel):
    """The part of PEFT's adapter_config.json the store relies on (other keys pass through)."""

    model_config = ConfigDict(extra="allow")

    peft_type: str = "LORA"
    r: int = Field(ge=1)
    lora_alpha: float
    target_modules: list[str] | str
    base_model_name_or_path: str | None = None
    rank_pattern: dict[str, int] = Field(default_factory=dict)
    use_dora: bool = False
    modules_to_save: list[str] | None = None

    @model_validator(mode="after")
    def _lora_only(self) -> LoraConfigFile:
        if self.peft_type.upper() != "LORA":
            raise ValueError(f"peft_type must be LORA, got {self.peft_type!r}")
        if self.use_dora:
            raise ValueError("DoRA adapters (use_dora=true) are not supported")
        if self.modules_to_save:
            raise ValueError(
                f"modules_to_save={self.modules_to_save} adds full weights; only LoRA is served"
            )
        return self


class AdapterInfo(BaseModel):
    """What validation learned about an adapter folder (becomes part of its manifest)."""

    files: list[Path]
    base_model: str | None
    base_model_fingerprint: str | None
    rank: int
    alpha: float
    target_modules: list[str]
    num_layers: int
    dtype: str


class CompositionFile(BaseModel):
    """composition.json, re-validated here without importing the runtime."""

    model_config = ConfigDict(extra="forbid")

    format: str = COMPOSITION_FORMAT
    format_version: int = 1
    base_model: str = Field(min_length=1)
    adapters: list[str] = Field(min_length=1)
    top_k: int = Field(2, ge=1)
    temperature: float = Field(1.0, gt=0)
    num_layers: int = Field(ge=1)
    hidden_size: int = Field(ge=1)

    @model_validator(mode="after")
    def _check(self) -> CompositionFile:
        if self.format != COMPOSITION_FORMAT:
            raise ValueError(f"format must be {COMPOSITION_FORMAT!r}, got {self.format!r}")
        if self.format_version != 1:
            raise ValueError(f"unsupported format_version {self.format_version}")
        names = [parse_ref(ref).name for ref in self.adapters]
        if len(set(names)) != len(names):
            raise ValueError("a composition lists an adapter twice")
        if self.top_k > len(self.adapters):
            raise ValueError(f"top_k={self.top_k} exceeds the {len(self.adapters)} adapters")
        return self


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


def _base_dims(cfg: dict[str, Any]) -> tuple[int, dict[str, tuple[int, int]]]:
    """(num layers, leaf → (in, out)) for Llama/Qwen/Mistral-style decoders."""
    try:
        hidden, heads, layers = (
            cfg["hidden_size"],
            cfg["num_attention_heads"],
            cfg["num_hidden_layers"],
        )
        inter = cfg["intermediate_size"]
    except KeyError as exc:
        raise InvalidInputError(f"base model config lacks {exc.args[0]!r}") from None
    kv = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    q, kvd = heads * head_dim, kv * head_dim
    dims = {
        "q_proj": (hidden, q), "k_proj": (hidden, kvd), "v_proj": (hidden, kvd), "o_proj": (q, hidden),
        "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
    }  # fmt: skip
    return layers, dims


def _expected_rank(module: str, cfg: LoraConfigFile) -> int:
    for pattern, rank in cfg.rank_pattern.items():
        if module == pattern or module.endswith("." + pattern) or re.fullmatch(pattern, module):
            return rank
    return cfg.r


def validate_adapter(
    folder: Path, base_config: dict[str, Any] | None = None, max_bytes: int = DEFAULT_MAX_BYTES
) -> AdapterInfo:
    """Check a PEFT LoRA folder; every failure is an InvalidInputError saying what and where."""
    folder = Path(folder)
    files = _check_files(folder, [ADAPTER_CONFIG, ADAPTER_WEIGHTS], [README], max_bytes)
    try:
        cfg = LoraConfigFile.model_validate(json.loads((folder / ADAPTER_CONFIG).read_text()))
    except (ValidationError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"{ADAPTER_CONFIG} is not a valid PEFT LoRA config: {exc}") from exc
    header = read_header(folder / ADAPTER_WEIGHTS)
    if not header:
        raise InvalidInputError(f"{ADAPTER_WEIGHTS} holds no tensors")
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    dtypes: set[str] = set()
    for key, info in header.items():
        m = LORA_KEY.match(key)
        if not m:
            raise InvalidInputError(
                f"{ADAPTER_WEIGHTS}: tensor {key!r} is not a LoRA A/B weight (only LoRA is served)"
            )
        if info.dtype not in FLOAT_DTYPES:
            raise InvalidInputError(
                f"{ADAPTER_WEIGHTS}: tensor {key!r} has non-float dtype {info.dtype}"
            )
        if len(info.shape) != 2:
            raise InvalidInputError(f"{ADAPTER_WEIGHTS}: tensor {key!r} is not 2-D: {info.shape}")
        dtypes.add(info.dtype)
        pairs.setdefault(m["module"], {})[m["ab"]] = info.shape
    base = _base_dims(base_config) if base_config is not None else None
    leaves: set[str] = set()
    max_layer = -1
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise InvalidInputError(f"{ADAPTER_WEIGHTS}: module {module!r} lacks {missing}")
        (r_a, d_in), (d_out, r_b) = ab["A"], ab["B"]
        rank = _expected_rank(module, cfg)
        if not r_a == r_b == rank:
            raise InvalidInputError(
                f"{module}: lora_A {ab['A']} / lora_B {ab['B']} disagree with rank r={rank}"
            )
        leaf = module.rsplit(".", 1)[-1]
        targets = cfg.target_modules
        if isinstance(targets, str):
            if not re.fullmatch(targets, module):
                raise InvalidInputError(f"{module} does not match target_modules {targets!r}")
        elif leaf not in targets:
            raise InvalidInputError(f"{module}: {leaf!r} is not in target_modules {targets}")
        leaves.add(leaf)
        layer = LAYER_INDEX.search(module)
        if layer:
            max_layer = max(max_layer, int(layer.group(1)))
        if base is not None:
            n_layers, dims = base
            if leaf not in dims:
                raise InvalidInputError(f"{module}: cannot check {leaf!r} against the base model")
            if layer and int(layer.group(1)) >= n_layers:
                raise InvalidInputError(f"{module}: base model has only {n_layers} layers")
            if (d_in, d_out) != dims[leaf]:
                raise InvalidInputError(
                    f"{module}: LoRA maps {d_in}→{d_out} but the base model's {leaf} is "
                    f"{dims[leaf][0]}→{dims[leaf][1]}"
                )
    if isinstance(cfg.target_modules, list):
        unused = sorted(set(cfg.target_modules) - leaves)
        if unused:
            raise InvalidInputError(
                f"target_modules {unused} have no LoRA tensors in {ADAPTER_WEIGHTS}"
            )
    return AdapterInfo(
        files=files,
        base_model=cfg.base_model_name_or_path,
        base_model_fingerprint=config_fingerprint(base_config) if base_config is not None else None,
        rank=cfg.r,
        alpha=cfg.lora_alpha,
        target_modules=sorted(leaves),
        num_layers=max_layer + 1 if max_layer >= 0 else 1,
        dtype=",".join(sorted(dtypes)),
    )


def read_composition(
    folder: Path, max_bytes: int = DEFAULT_MAX_BYTES
) -> tuple[list[Path], CompositionFile]:
    """Check a composition folder (format, refs, gate shapes, finite values)."""
    folder = Path(folder)
    files = _check_files(folder, [COMPOSITION_CONFIG, GATES_FILE], [README], max_bytes)
    try:
        cfg = CompositionFile.model_validate(json.loads((folder / COMPOSITION_CONFIG).read_text()))
    except (ValidationError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"invalid {COMPOSITION_CONFIG}: {exc}") from exc
    header = read_header(folder / GATES_FILE)
    extra = sorted(set(header) - {"gate.weight", "gate.bias"})
    if extra or "gate.weight" not in header:
        raise InvalidInputError(
            f"{GATES_FILE} must hold 'gate.weight' (and optionally 'gate.bias'); found {sorted(header)}"
        )
    k = len(cfg.adapters)
    expected = {
        "gate.weight": (cfg.num_layers, k, cfg.hidden_size),
        "gate.bias": (cfg.num_layers, k),
    }
    for tname, info in header.items():
        if info.shape != expected[tname]:
            raise InvalidInputError(
                f"{GATES_FILE}: {tname} has shape {info.shape}, expected {expected[tname]} "
                "(num_layers, K adapters, hidden_size)"
            )
        values = read_float_tensor(folder / GATES_FILE, tname)
        if not (values == values).all() or (abs(values) == float("inf")).any():
            raise InvalidInputError(f"{GATES_FILE}: {tname} holds NaN or Inf values")
    return files, cfg
