"""The base model an adapter was trained on: its decoder shapes, identity and declared name."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from adapter_store.errors import RuleError

# The architecture fields that decide every weight shape: the base model's identity.
IDENTITY_FIELDS = (
    "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size",
)  # fmt: skip


@dataclass(frozen=True)
class BaseShapes:
    """Decoder layers and (in, out) of each servable projection of a base model."""

    num_layers: int
    dims: dict[str, tuple[int, int]]


def base_shapes(cfg: Mapping[str, Any]) -> BaseShapes:
    """Shapes of a Llama/Qwen/Mistral-style decoder from its HF config.json."""
    try:
        hidden, heads, layers = (
            int(cfg["hidden_size"]),
            int(cfg["num_attention_heads"]),
            int(cfg["num_hidden_layers"]),
        )
        inter = int(cfg["intermediate_size"])
    except KeyError as exc:
        raise RuleError(f"base model config lacks {exc.args[0]!r}") from None
    kv = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    q, kvd = heads * head_dim, kv * head_dim
    dims = {
        "q_proj": (hidden, q), "k_proj": (hidden, kvd), "v_proj": (hidden, kvd), "o_proj": (q, hidden),
        "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
    }  # fmt: skip
    return BaseShapes(layers, dims)


def base_identity(cfg: Mapping[str, Any]) -> str:
    """sha256 of the architecture fields that decide every weight shape (IDENTITY_FIELDS)."""
    heads = cfg.get("num_attention_heads")
    canon = {k: cfg.get(k) for k in IDENTITY_FIELDS}
    canon["num_key_value_heads"] = canon["num_key_value_heads"] or heads
    if not canon["head_dim"] and heads and cfg.get("hidden_size"):
        canon["head_dim"] = int(cfg["hidden_size"]) // int(heads)
    return hashlib.sha256(json.dumps(canon, sort_keys=True).encode()).hexdigest()


def _norm_name(name: str) -> str:
    return name.rstrip("/").rsplit("/", 1)[-1].lower()


def check_declared_base(
    declared_name: str | None,
    declared_identity: str | None,
    served_names: Iterable[str],
    served_identity: str | None,
) -> None:
    """Refuse an adapter published for another base model than the served one.

    The identity (recorded when the adapter was pushed with the base's config.json) decides
    when both sides have one. Otherwise a declared hub id (`org/name`) or alias must match
    one of the served model's names (case-insensitive, by last path component); a declared
    local path cannot be checked and passes (its shapes are still checked).
    """
    served = [n for n in served_names if n]
    if declared_identity and served_identity:
        if declared_identity != served_identity:
            raise RuleError(
                f"was published for base model {declared_name!r} (identity "
                f"{declared_identity[:12]}…) but this server runs {served[0] if served else '?'!r} "
                f"(identity {served_identity[:12]}…): base-model mismatch"
            )
        return
    if (
        not declared_name
        or declared_name.startswith(("/", ".", "~"))
        or declared_name.count("/") > 1
    ):
        return
    if _norm_name(declared_name) not in {_norm_name(n) for n in served}:
        raise RuleError(
            f"declares base model {declared_name!r} but this server runs "
            f"{served[0] if served else '?'!r}: base-model mismatch"
        )
