"""Architecture hyper-parameters read from an HF `config.json` (Llama and Qwen3 families)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen3")


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is not one this decoder implements."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # "default" or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelArch:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool
    attention_bias: bool
    rope: RopeConfig = field(default_factory=RopeConfig)
    name_or_path: str = ""
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def linear_shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a LoRA-targetable projection."""
        d, hd = self.hidden_size, self.head_dim
        return {
            "q_proj": (d, self.num_heads * hd),
            "k_proj": (d, self.num_kv_heads * hd),
            "v_proj": (d, self.num_kv_heads * hd),
            "o_proj": (self.num_heads * hd, d),
            "gate_proj": (d, self.intermediate_size),
            "up_proj": (d, self.intermediate_size),
            "down_proj": (self.intermediate_size, d),
        }[module]

    def fingerprint(self) -> dict[str, Any]:
        """What an adapter must agree with to be applied to this model."""
        return {
            "model_type": self.model_type,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
        }


def _rope_from(config: dict[str, Any]) -> RopeConfig:
    params = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ("default", "llama3"):
        raise UnsupportedModelError(f"rope scaling type {kind!r} is not supported")
    if kind == "default":
        return RopeConfig(theta=theta)
    return RopeConfig(
        theta=theta,
        kind=kind,
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def arch_from_config(config: dict[str, Any]) -> ModelArch:
    model_type = config.get("model_type", "")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: {list(SUPPORTED_MODEL_TYPES)}"
        )
    if config.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {config.get('hidden_act')!r} is not supported")
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    eos = config.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    return ModelArch(
        model_type=model_type,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qk_norm=model_type == "qwen3",
        attention_bias=bool(config.get("attention_bias", False)),
        rope=_rope_from(config),
        name_or_path=str(config.get("_name_or_path", "")),
        eos_token_ids=tuple(int(e) for e in eos_ids),
        bos_token_id=config.get("bos_token_id"),
    )


def load_arch(folder: str | Path) -> ModelArch:
    path = Path(folder) / "config.json"
    return arch_from_config(json.loads(path.read_text()))
