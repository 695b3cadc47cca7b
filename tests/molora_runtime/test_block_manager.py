"""The block manager alone: reference counts, the prefix index, LRU eviction of cached blocks."""

from __future__ import annotations

from molora_runtime.engine.scheduling.block_manager import BlockManager
from molora_runtime.engine.scheduling.route_key import chain_block_hash

ID_A, ID_B = b"a" * 32, b"b" * 32


def manager(blocks: int = 8) -> BlockManager:
    return BlockManager(blocks, 4, chain_block_hash)


def test_allocate_and_free_counts() -> None:
    bm = manager()
    table, cached = bm.allocate(ID_A, list(range(10)), 10)
    assert len(table) == 3 and cached == 0 and bm.num_used == 3
    bm.append_block(table)
    assert bm.num_used == 4 and bm.num_free == 4
    bm.free(table)
    assert table == [] and bm.num_used == 0 and bm.num_free == 8


def test_registered_prefix_is_shared_and_never_whole() -> None:
    bm = manager()
    prompt = list(range(12))
    t1, _ = bm.allocate(ID_A, prompt, 12)
    bm.register(t1, ID_A, prompt, [])
    assert bm.num_cached == 3
    # the same prompt: its last token is always computed, so the third block is not reused
    t2, cached = bm.allocate(ID_A, prompt, 12)
    assert cached == 8 and t2[:2] == t1[:2] and t2[2] != t1[2]
    assert bm.blocks[t1[0]].refs == 2
    # another identity shares nothing; a different first block breaks the chain
    t3, cached = bm.allocate(ID_B, prompt, 12)
    assert cached == 0 and not set(t3) & set(t1)
    bm.free(t3)
    _t4, cached = bm.allocate(ID_A, [99, *prompt[1:]], 12)
    assert cached == 0
    assert bm.counters.prefix_hit_tokens == 8


def test_unheld_cached_blocks_are_evicted_lru_after_plain_ones() -> None:
    bm = manager(5)
    old = list(range(8))
    t1, _ = bm.allocate(ID_A, old, 8)
    bm.register(t1, ID_A, old, [])
    first = list(t1)
    bm.free(t1)
    assert bm.num_free == 5 and bm.num_cached == 2
    # two never-used blocks go first; the cached prefix survives them
    t2, _ = bm.allocate(ID_B, [], 8)
    assert not set(t2) & set(first) and bm.num_cached == 2
    assert bm.can_allocate(ID_A, [*old, 1], 9)  # both cached blocks count as there
    assert not bm.can_allocate(ID_A, [*old, 1], 13)
    t3, cached = bm.allocate(ID_A, [*old, 1], 9)
    assert cached == 8 and t3[:2] == first
    bm.free(t3)
    bm.free(t2)
    # now taking blocks evicts the cached ones, the tail block (freed first) before the head
    t4, _ = bm.allocate(ID_B, [], 16)
    assert bm.counters.evictions == 1 and first[0] not in t4 and bm.num_cached == 1
    t5, _ = bm.allocate(ID_B, [], 4)
    assert t5 == [first[0]] and bm.num_cached == 0 and bm.counters.evictions == 2


def test_forget_unindexes_only_blocks_it_alone_holds() -> None:
    bm = manager()
    prompt = list(range(9))
    t1, _ = bm.allocate(ID_A, prompt, 9)
    bm.register(t1, ID_A, prompt, [])
    t2, cached = bm.allocate(ID_A, prompt, 9)
    assert cached == 8
    own = bm.forget(t2)
    assert own == [t2[2]] and bm.num_cached == 2  # the shared prefix stays indexed


def test_kv_config_is_validated() -> None:
    import pytest
    from pydantic import ValidationError

    from molora_runtime.config import EngineConfig

    with pytest.raises(ValidationError, match="kv_cache_bytes or kv_cache_fraction, not both"):
        EngineConfig(kv_cache_bytes=1 << 20, kv_cache_fraction=0.5)
    with pytest.raises(ValidationError, match="power of two"):
        EngineConfig(kv_block_size=12)
    with pytest.raises(ValidationError):
        EngineConfig(kv_cache_fraction=1.5)
    assert EngineConfig(kv_cache_bytes=1 << 30).kv_block_size == 16
