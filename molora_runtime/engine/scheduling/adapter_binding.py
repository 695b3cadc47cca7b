"""A sequence's hold on the hot-set: its adapters (and composition gates) bound while it runs."""

from __future__ import annotations

from collections.abc import Iterable

from molora_runtime.engine.sequence import Sequence
from molora_runtime.lora.hotset import HotSet


class AdapterBinder:
    """Binds and releases the hot-set slots a sequence needs; admission asks it first."""

    def __init__(self, hot_set: HotSet) -> None:
        self.hot_set = hot_set

    def bind(self, seq: Sequence, wait_for_loads: bool = True) -> bool:
        """Hold every slot `seq` needs; False (holding nothing) when it must wait: its gate slot
        or adapter slots are taken by running requests, or its adapters are still loading."""
        hot = self.hot_set
        comp = seq.composition
        needs = seq.route.adapters()
        if comp is not None and not hot.can_hold_composition(comp):
            return False
        if comp is not None:
            cslot, experts = hot.ensure_composition(comp)
            needs = list(dict.fromkeys(needs + experts))
        if not hot.can_hold(needs):
            return False
        if wait_for_loads and not hot.ready(needs):
            return False  # parsing in the background: wait without holding back the batch
        hot.ensure(needs)
        hot.acquire(needs)
        seq.adapters = needs
        if comp is not None:
            hot.acquire_composition(comp)
            hot.bind_experts(cslot)
        return True

    def resident(self, seq: Sequence) -> bool:
        """Whether `seq` could start without a load or a new slot: a plain route whose adapters
        all sit in slots now (a composition is judged by `bind`)."""
        return seq.composition is None and self.hot_set.resident(seq.route.adapters())

    def files_ready(self, seq: Sequence) -> bool:
        """Whether `seq`'s adapters are resident or parsed in host memory (so their files are
        local); missing ones start loading in the background."""
        return self.hot_set.ready(seq.route.adapters())

    def release(self, seq: Sequence) -> None:
        self.hot_set.release(seq.adapters)
        if seq.composition is not None and seq.adapters:
            self.hot_set.release_composition(seq.composition)
        seq.adapters = []

    def prefetch(self, waiting: Iterable[Sequence]) -> None:
        """Warm empty slots with adapters of queued requests (never evicts)."""
        for seq in list(waiting)[:4]:
            self.hot_set.prefetch(seq.route.adapters())
