"""The prefix-cache key must change with every part a prefix's KV depends on.

Each case flips one part of a route (or of an adapter's files) and checks the identity moves;
a key that ignored that part would let two different computations share KV blocks.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from molora_runtime.engine.scheduling.route_key import RouteIdentities, chain_block_hash
from molora_runtime.lora.source import DirectorySource
from molora_runtime.routes import BaseRoute, MixRoute, SingleRoute, VocabRange, VocabRoute


def _adapter(folder: Path, weights: bytes, alpha: int = 16) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_model.safetensors").write_bytes(weights)
    (folder / "adapter_config.json").write_text(f'{{"r": 8, "lora_alpha": {alpha}}}')
    return folder


@pytest.fixture()
def ids(tmp_path: Path) -> RouteIdentities:
    source = DirectorySource(
        {
            "a": _adapter(tmp_path / "a", b"A"),
            "b": _adapter(tmp_path / "b", b"B"),
            "a@2": _adapter(tmp_path / "a2", b"A2"),
            "same-bytes": _adapter(tmp_path / "c", b"A"),
        }
    )
    return RouteIdentities("smollm2", source)


def test_equal_routes_equal_keys(ids: RouteIdentities) -> None:
    assert ids.identity(SingleRoute(adapter="a")) == ids.identity(SingleRoute(adapter="a"))
    assert ids.identity(BaseRoute()) == ids.identity(BaseRoute())


def test_versions_names_and_weights_never_collide(ids: RouteIdentities, tmp_path: Path) -> None:
    keys = {ids.identity(SingleRoute(adapter=r)) for r in ("a", "a@2", "same-bytes", "b")}
    assert len(keys) == 4  # a@2 differs from a; equal bytes under another name differ too
    before = ids.identity(SingleRoute(adapter="a"))
    (tmp_path / "a" / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 32}')
    assert ids.identity(SingleRoute(adapter="a")) != before  # same weights, other alpha


def test_mix_weights_and_vocab_tables_are_part_of_the_key(ids: RouteIdentities) -> None:
    mix = [MixRoute(weights={"a": 0.7, "b": 0.3}), MixRoute(weights={"a": 0.6, "b": 0.4})]
    assert ids.identity(mix[0]) != ids.identity(mix[1])
    tables = [
        VocabRoute(ranges=[VocabRange(start=0, end=100, adapter="a")], default="b"),
        VocabRoute(ranges=[VocabRange(start=0, end=101, adapter="a")], default="b"),
        VocabRoute(ranges=[VocabRange(start=0, end=100, adapter="b")], default="b"),
        VocabRoute(ranges=[VocabRange(start=0, end=100, adapter="a")], default=None),
    ]
    assert len({ids.identity(t) for t in tables}) == len(tables)
    assert ids.identity(BaseRoute()) not in {ids.identity(t) for t in tables}


def test_other_base_model_other_key(ids: RouteIdentities) -> None:
    other = RouteIdentities("qwen3", ids.source)
    assert other.identity(BaseRoute()) != ids.identity(BaseRoute())


def test_block_chain_depends_on_parent_identity_and_tokens() -> None:
    ident = b"\1" * 32
    root = chain_block_hash(None, ident, [1, 2, 3])
    assert chain_block_hash(None, ident, [1, 2, 3]) == root
    assert chain_block_hash(root, ident, [1, 2, 3]) != root
    assert chain_block_hash(None, b"\2" * 32, [1, 2, 3]) != root
    assert chain_block_hash(None, ident, [1, 2, 4]) != root
