"""A hostile publisher's adapters: each is refused at push with a clear message and nothing stored.

Values that would overflow a slot after scale and cast, absurd alpha or rank, regexes that make a
backtracking engine run for minutes, configs nested to blow the parser's stack, tensors sharing
bytes, and links that point at someone else's files.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from adapter_store import InvalidInputError, open_registry
from adapter_store.limits import MAX_ABS_WEIGHT

Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
# Exponential for a backtracking engine against a 31-character module path.
REDOS = r"(.*.*)*\.q_proj_x"


def _config(folder: Path, **changes: object) -> None:
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps(cfg | changes))


def _tensor(folder: Path, key: str, fn: Callable[[np.ndarray], np.ndarray]) -> None:
    path = folder / "adapter_model.safetensors"
    tensors = load_file(str(path))
    save_file(tensors | {key: fn(tensors[key]).astype(np.float32)}, str(path))


def _overlap(folder: Path) -> None:
    """Point q_proj's B at A's bytes (same size: a reshaped alias), header rewritten by hand."""
    path = folder / "adapter_model.safetensors"
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    a, b = header[Q_A], header[Q_B]
    b["data_offsets"] = [
        a["data_offsets"][0],
        a["data_offsets"][0] + b["data_offsets"][1] - b["data_offsets"][0],
    ]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


def _deep(folder: Path) -> None:
    cfg = (folder / "adapter_config.json").read_text()
    (folder / "adapter_config.json").write_text(
        cfg[:-1] + ', "x": ' + "[" * 5_000 + "]" * 5_000 + "}"
    )


def _symlinked_readme(folder: Path) -> None:
    secret = folder.parent / "other-tenant-secret.txt"
    secret.write_text("another tenant's notes")
    (folder / "README.md").unlink(missing_ok=True)
    (folder / "README.md").symlink_to(secret)


def _hardlinked_readme(folder: Path) -> None:
    secret = folder.parent / "other-tenant-file.txt"
    secret.write_text("another tenant's notes")
    (folder / "README.md").unlink(missing_ok=True)
    os.link(secret, folder / "README.md")


ATTACKS: dict[str, tuple[Callable[[Path], None], str]] = {
    "huge-finite-b": (lambda f: _tensor(f, Q_B, lambda t: np.full_like(t, 3e38)), "over the bound 10000 on slot contents"),
    "scaled-b-overflows": (lambda f: (_config(f, lora_alpha=4096), _tensor(f, Q_B, lambda t: np.full_like(t, 20.0))), r"x scale 1.02e\+03"),
    "huge-a": (lambda f: _tensor(f, Q_A, lambda t: np.full_like(t, -2e4)), "over the bound"),
    "alpha-1e38": (lambda f: _config(f, lora_alpha=1e38), "lora_alpha"),
    "alpha-pattern-huge": (lambda f: _config(f, alpha_pattern={"q_proj": 1e30}), "alpha_pattern"),
    "rank-huge": (lambda f: _config(f, r=10**9), r"\br\b.*less than or equal to 1024"),
    "rank-pattern-huge": (lambda f: _config(f, rank_pattern={"q_proj": 10**6}), "rank_pattern"),
    "redos-target": (lambda f: _config(f, target_modules=REDOS), "is not in target_modules"),
    "redos-rank-pattern": (lambda f: _config(f, rank_pattern={r"(a|a)*(a|a)*\1": 4}), "not valid RE2 syntax"),
    "long-pattern": (lambda f: _config(f, target_modules="q_proj|" * 100), "over 256"),
    "many-patterns": (lambda f: _config(f, rank_pattern={f"m{i}": 4 for i in range(100)}), "more than 64"),
    "deep-config": (_deep, "nests deeper than 8"),
    "huge-config": (lambda f: _config(f, notes="x" * 100_000), "over 65536 bytes"),
    "overlapping-offsets": (_overlap, "overlap in the file"),
    "symlinked-readme": (_symlinked_readme, "symbolic link"),
    "hardlinked-readme": (_hardlinked_readme, "hard links"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(ATTACKS))
def test_hostile_adapter_refused_at_push(alpha: Path, tmp_path: Path, case: str) -> None:
    registry = open_registry(str(tmp_path / "store"), create=True)
    mutate, message = ATTACKS[case]
    mutate(alpha)
    with pytest.raises(InvalidInputError, match=message):
        registry.publish_adapter(alpha, "bad", "1")
    assert registry.backend.list_keys("") == []


def test_bounds_at_the_edge_are_served(alpha: Path, tmp_path: Path) -> None:
    """Exactly at the bounds passes: the rules refuse attacks, not unusual adapters."""
    registry = open_registry(str(tmp_path / "store"), create=True)
    _config(alpha, lora_alpha=4.0, rank_pattern={r"layers\.0\.self_attn\.q_proj": 4})
    _tensor(alpha, Q_B, lambda t: np.full_like(t, MAX_ABS_WEIGHT))  # scale 4/4 = 1
    _tensor(alpha, Q_A, lambda t: np.full_like(t, -MAX_ABS_WEIGHT))
    registry.publish_adapter(alpha, "edge", "1")
    assert registry.names("adapter") == ["edge"]


def test_regex_target_matches_canonical_paths(alpha: Path, tmp_path: Path) -> None:
    """A string target_modules is a PEFT regex over module paths, run by RE2."""
    registry = open_registry(str(tmp_path / "store"), create=True)
    _config(alpha, target_modules=r".*\.(q_proj|v_proj|down_proj)")
    registry.publish_adapter(alpha, "regex", "1")
    assert registry.names("adapter") == ["regex"]
