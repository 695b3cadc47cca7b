"""Paged KV blocks and the prefix cache (nano-vllm's block manager, keyed by route identity).

A sequence's KV lives in fixed-size blocks listed in its block table. A block that is full and
computed is registered under a chain hash over (route identity, its tokens, the hash of the block
before it), so a later sequence with the same route identity and the same prefix reuses it instead
of prefilling again. Blocks nobody holds stay cached until a fresh block is needed; the least
recently freed is evicted first. Blocks never registered are handed out before cached ones.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

ChainHash = Callable[[bytes | None, bytes, Sequence[int]], bytes]


@dataclass
class Block:
    """One KV block: who holds it, and the chain hash it is indexed under once full."""

    block_id: int
    refs: int = 0
    hash: bytes | None = None
    token_ids: list[int] = field(default_factory=list)  # set when registered (hash check)


@dataclass
class BlockCounters:
    """The prefix cache's hit counts, for the stats."""

    prefix_hit_tokens: int = 0  # prompt tokens served from cached blocks
    prefix_queried_tokens: int = 0  # prompt tokens looked up
    evictions: int = 0  # cached blocks reused for other data


class BlockManager:
    """Owns the KV block pool: allocation, reference counts, the hash → block prefix index."""

    def __init__(
        self, num_blocks: int, block_size: int, chain_hash: ChainHash, prefix_caching: bool = True
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.chain_hash = chain_hash
        self.prefix_caching = prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # never registered; pop()
        self._cached: OrderedDict[int, None] = OrderedDict()  # registered, unheld; LRU first
        self._index: dict[bytes, int] = {}
        self.counters = BlockCounters()

    # ----- accounting -----------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (never used, or cached and unheld)."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._index)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ----- allocation -----------------------------------------------------------------------
    def _take(self) -> int:
        if self._free:
            bid = self._free.pop()
        else:
            bid, _ = self._cached.popitem(last=False)
            block = self.blocks[bid]
            if block.hash is not None and self._index.get(block.hash) == bid:
                del self._index[block.hash]
            block.hash, block.token_ids = None, []
            self.counters.evictions += 1
        self.blocks[bid].refs = 1
        return bid

    def _hold(self, bid: int) -> None:
        block = self.blocks[bid]
        if block.refs == 0:
            self._cached.pop(bid, None)
        block.refs += 1

    def prefix_hashes(self, identity: bytes, token_ids: Sequence[int]) -> list[bytes]:
        """Chain hashes of the full blocks of `token_ids` (the lookup keys of a prompt)."""
        out: list[bytes] = []
        parent: bytes | None = None
        bs = self.block_size
        for i in range(len(token_ids) // bs):
            parent = self.chain_hash(parent, identity, token_ids[i * bs : (i + 1) * bs])
            out.append(parent)
        return out

    def cached_prefix(self, identity: bytes, token_ids: Sequence[int]) -> list[int]:
        """Blocks already holding the longest cached prefix of `token_ids` (full blocks only)."""
        if not self.prefix_caching:
            return []
        hits: list[int] = []
        bs = self.block_size
        for i, h in enumerate(self.prefix_hashes(identity, token_ids)):
            bid = self._index.get(h)
            if bid is None or self.blocks[bid].token_ids != list(token_ids[i * bs : (i + 1) * bs]):
                break
            hits.append(bid)
        return hits

    def can_allocate(
        self, identity: bytes, token_ids: Sequence[int], num_tokens: int, reserve: int = 0
    ) -> bool:
        """Whether `num_tokens` of KV fit now, counting cached prefix blocks as already there,
        leaving `reserve` blocks free for running sequences to grow into."""
        hits = self.cached_prefix(identity, token_ids[: max(0, len(token_ids) - 1)])
        unheld_hits = sum(1 for b in hits if self.blocks[b].refs == 0)
        need = self.blocks_for(num_tokens) - len(hits)
        return need + reserve <= self.num_free - unheld_hits

    def allocate(
        self, identity: bytes, token_ids: Sequence[int], num_tokens: int
    ) -> tuple[list[int], int]:
        """A block table for `num_tokens` tokens whose first ones are `token_ids`; returns it
        and how many leading tokens are already cached (never all of them: the last token is
        computed so its logits exist)."""
        lookup = token_ids[: max(0, len(token_ids) - 1)]
        hits = self.cached_prefix(identity, lookup)
        for bid in hits:
            self._hold(bid)
        table = hits + [self._take() for _ in range(self.blocks_for(num_tokens) - len(hits))]
        cached = len(hits) * self.block_size
        self.counters.prefix_queried_tokens += len(token_ids)
        self.counters.prefix_hit_tokens += cached
        return table, cached

    def append_block(self, table: list[int]) -> None:
        """Grow a block table by one fresh block (the caller checked `num_free`)."""
        table.append(self._take())

    def register(
        self, table: list[int], identity: bytes, token_ids: Sequence[int], hashes: list[bytes]
    ) -> None:
        """Index every full, computed block of `table` (`token_ids` are its computed tokens);
        `hashes` holds the chain hashes already known for this table and is extended."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        for i in range(len(hashes), len(token_ids) // bs):
            chunk = list(token_ids[i * bs : (i + 1) * bs])
            h = self.chain_hash(hashes[-1] if hashes else None, identity, chunk)
            hashes.append(h)
            block = self.blocks[table[i]]
            owner = self._index.get(h)
            if block.hash == h or (owner is not None and owner != block.block_id):
                continue  # shared hit, or the same prefix computed twice at once: keep the first
            block.hash, block.token_ids = h, chunk
            self._index[h] = block.block_id

    def free(self, table: list[int]) -> None:
        """Drop a sequence's references; unheld registered blocks stay cached (LRU), the tail
        first so a shared prefix outlives the suffixes that hang off it."""
        for bid in reversed(table):
            block = self.blocks[bid]
            block.refs -= 1
            if block.refs == 0:
                if block.hash is not None:
                    self._cached[bid] = None
                else:
                    self._free.append(bid)
        table.clear()

    def forget(self, table: list[int]) -> list[int]:
        """Unregister the blocks only this table holds (their data is bad); returns them."""
        own = [b for b in table if self.blocks[b].refs == 1]
        for bid in own:
            block = self.blocks[bid]
            if block.hash is not None and self._index.get(block.hash) == bid:
                del self._index[block.hash]
            block.hash, block.token_ids = None, []
        return own
