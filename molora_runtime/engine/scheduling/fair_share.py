"""Per-tenant shares of the engine's sequence slots and KV blocks (weighted, equal by default).

Every tenant with work (running or waiting) is entitled to `weight / sum of active weights` of
`max_num_seqs` and of the KV blocks. Admission serves the waiting queue in weighted order (the
tenant furthest below its share first, FIFO within a tenant), and a tenant still under its share
may take a slot or blocks back from a tenant over its share (that tenant's newest sequence is
preempted and recomputed later), so one tenant's burst never locks another out. Requests without
a tenant share one anonymous bucket; with a single tenant the queue is plain FIFO.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable

from molora_runtime.engine.sequence import Sequence

ANONYMOUS = ""  # the bucket of requests without a tenant (tenant names are non-empty)


def tenant_of(seq: Sequence) -> str:
    return seq.request.tenant or ANONYMOUS


class FairShare:
    """Weights and the share arithmetic; holds no sequence state of its own."""

    def __init__(self, weights: dict[str, float], max_num_seqs: int, num_blocks: int) -> None:
        self.weights = dict(weights)
        self.max_num_seqs = max_num_seqs
        self.num_blocks = num_blocks

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def _active(self, *groups: Iterable[Sequence]) -> set[str]:
        return {tenant_of(s) for group in groups for s in group}

    def order(self, waiting: deque[Sequence], running: list[Sequence]) -> deque[Sequence]:
        """`waiting` in weighted fair order: a tenant's k-th waiting sequence ranks by
        (its running sequences + k) / weight; ties keep arrival order."""
        if len(self._active(waiting, running)) <= 1:
            return waiting
        used = Counter(tenant_of(s) for s in running)
        seen: Counter[str] = Counter()
        ranked = []
        for i, seq in enumerate(waiting):
            t = tenant_of(seq)
            seen[t] += 1
            ranked.append(((used[t] + seen[t]) / self.weight(t), i, seq))
        ranked.sort(key=lambda r: (r[0], r[1]))
        return deque(seq for _, _, seq in ranked)

    def shares(self, waiting: Iterable[Sequence], running: list[Sequence]) -> dict[str, float]:
        """Each active tenant's fraction of the engine."""
        active = self._active(waiting, running)
        total = sum(self.weight(t) for t in active) or 1.0
        return {t: self.weight(t) / total for t in active}

    def victim(
        self,
        seq: Sequence,
        need_blocks: int,
        waiting: Iterable[Sequence],
        running: list[Sequence],
    ) -> Sequence | None:
        """A running sequence to preempt so `seq` can start, or None when `seq`'s tenant would
        exceed its own share (`need_blocks` > 0: blocks are short; else a slot is) or no other
        tenant is over its share. The victim is the newest sequence of the tenant furthest over."""
        share = self.shares([*waiting, seq], running)
        me = tenant_of(seq)
        if need_blocks:
            cap, cost = float(self.num_blocks), need_blocks
            use = Counter()
            for s in running:
                use[tenant_of(s)] += len(s.block_table)
        else:
            cap, cost = float(self.max_num_seqs), 1
            use = Counter(tenant_of(s) for s in running)
        if use[me] + cost > share[me] * cap:
            return None
        over = {t: use[t] / (share[t] * cap) for t in use if t != me and use[t] > share[t] * cap}
        if not over:
            return None
        worst = max(over, key=lambda t: over[t])
        return next(s for s in reversed(running) if tenant_of(s) == worst)
