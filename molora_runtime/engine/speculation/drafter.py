"""The drafter: proposes each decoding sequence's draft from its own history (and, with `suffix`,
its route's recent answers), and adapts how many tokens it drafts to what was accepted."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from molora_runtime.config import SpeculativeConfig
from molora_runtime.engine.speculation.ngram_index import SEPARATOR, NgramIndex
from molora_runtime.engine.speculation.route_memory import RouteMemory
from molora_runtime.engine.speculation.spec_counters import SpecCounters
from molora_runtime.routes import RouteSpec

ROUTE_MEMORIES = 256  # (tenant, route) memories kept, least recently used dropped


@dataclass
class SpecState:
    """One sequence's proposer state: its history's index, how many tokens it drafts, and
    the (tenant, route) whose memory it drafts from and adds its answer to."""

    index: NgramIndex
    k: int
    memory_key: tuple[str | None, str]


class Drafter:
    """Proposes each decoding sequence's draft and learns from what was accepted."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.lo, self.hi = config.prompt_lookup_min, config.prompt_lookup_max
        self.counters = SpecCounters()
        self._memories: OrderedDict[tuple[str | None, str], RouteMemory] = OrderedDict()

    def active(self, decoding: int) -> bool:
        """Whether a step with `decoding` sequences speculates at all."""
        return 0 < decoding <= self.config.max_batch

    def propose(self, state: SpecState, history: list[int]) -> list[int]:
        """Up to `state.k` tokens that followed the latest earlier occurrence of the longest
        n-gram ending `history`; [] when nothing matches."""
        state.index.extend(history)
        n, start = state.index.match(history)
        draft = history[start : start + state.k] if n else []
        if self.config.method == "suffix":
            memory = self._memories.get(state.memory_key)
            if memory is not None:
                self._memories.move_to_end(state.memory_key)
                m, at = memory.index.match(history)
                if m > n:
                    draft = memory.stream[at : at + state.k]
                    if SEPARATOR in draft:
                        draft = draft[: draft.index(SEPARATOR)]
        return draft

    def new_state(self, tenant: str | None, route: RouteSpec) -> SpecState:
        key = (tenant, route.model_dump_json())
        return SpecState(NgramIndex(self.lo, self.hi), self.config.num_speculative_tokens, key)

    def accepted(self, state: SpecState, route: RouteSpec, proposed: int, accepted: int) -> None:
        """Record one verification and adapt the sequence's k: one more after a full accept,
        half after none, unchanged after a partial one (a verified row costs a CPU step
        little next to a step, so k only shrinks where drafts keep failing)."""
        self.counters.record(route, proposed, accepted)
        top = self.config.num_speculative_tokens
        if accepted == proposed:
            state.k = min(top, state.k + 1)
        elif accepted == 0:
            state.k = max(1, state.k // 2)

    def remember(self, state: SpecState, answer: list[int]) -> None:
        """Keep a finished answer for later requests of the same tenant and route (suffix)."""
        if self.config.method != "suffix" or len(answer) < self.lo + 1:
            return
        key = state.memory_key
        memory = self._memories.get(key)
        if memory is None:
            memory = self._memories[key] = RouteMemory(self.lo, self.hi)
            while len(self._memories) > ROUTE_MEMORIES:
                self._memories.popitem(last=False)
        self._memories.move_to_end(key)
        memory.add(answer)
