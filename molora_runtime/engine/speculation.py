"""Draft-free speculative decoding: where draft tokens come from, how many, and what was accepted.

A decode that finds the end of its own history earlier in that history (the prompt it copies
from, or a phrase it already wrote) proposes the tokens that followed there; the step verifies
them in one forward under the request's own route, and the output processor keeps the longest
prefix the target agrees with. `ngram` is vLLM's prompt lookup (the longest n in
[prompt_lookup_min, prompt_lookup_max] whose latest earlier occurrence has a continuation);
`suffix` also looks in the recent answers of the same tenant and route, so an adapter that
keeps giving similar answers drafts from them, and takes the longer of the two matches.
Drafts never change outputs (verification is exact), only how many steps they take; a tenant's
answers only ever draft for that tenant, so acceptance timing tells nothing across tenants.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Tokens
from dataclasses import dataclass, field, replace

from molora_runtime.config import SpeculativeConfig
from molora_runtime.routes import RouteSpec

SEPARATOR = -1  # between answers in a route's memory: no match spans two answers
ROUTE_MEMORY_TOKENS = 1 << 16  # tokens of recent answers kept per tenant and route
ROUTE_MEMORIES = 256  # (tenant, route) memories kept, least recently used dropped


class NgramIndex:
    """The latest start of the continuation after every n-gram (n in [lo, hi]) of one growing
    token stream: `extend` indexes what was appended since, `match` looks the stream's own tail
    up (or another stream's tail, for a shared memory)."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(lo, hi + 1)}
        self.indexed = 0  # continuations [0, indexed) are in the tables

    def extend(self, stream: Tokens[int]) -> None:
        """Index every n-gram of `stream` that now has a continuation (ends before its last
        token)."""
        for end in range(max(self.indexed, self.lo), len(stream)):
            for n in range(self.lo, min(self.hi, end) + 1):
                gram = tuple(stream[end - n : end])
                if SEPARATOR not in gram:
                    self.tables[n][gram] = end
        self.indexed = max(self.indexed, len(stream))

    def match(self, tail: Tokens[int]) -> tuple[int, int]:
        """(n, continuation start) of the longest indexed n-gram ending `tail`; (0, -1) if none."""
        for n in range(min(self.hi, len(tail)), self.lo - 1, -1):
            start = self.tables[n].get(tuple(tail[len(tail) - n :]))
            if start is not None:
                return n, start
        return 0, -1


class RouteMemory:
    """Recent answers of one tenant on one route, as one stream with separators."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.stream: list[int] = []
        self.index = NgramIndex(lo, hi)

    def add(self, answer: Tokens[int]) -> None:
        if len(self.stream) + len(answer) + 1 > ROUTE_MEMORY_TOKENS:  # keep the newer half
            self.stream = self.stream[len(self.stream) // 2 :]
            self.index = NgramIndex(self.lo, self.hi)
        self.stream.extend(answer)
        self.stream.append(SEPARATOR)
        self.index.extend(self.stream)


@dataclass
class SpecState:
    """One sequence's proposer state: its history's index, how many tokens it drafts, and
    the (tenant, route) whose memory it drafts from and adds its answer to."""

    index: NgramIndex
    k: int
    memory_key: tuple[str | None, str]


@dataclass
class SpecTally:
    """Drafts proposed, draft tokens, tokens accepted."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0

    def add(self, proposed: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted += accepted


@dataclass
class SpecCounters:
    """Acceptance since the engine started: totals (vLLM's counters), per draft position, per
    route kind and per adapter/composition name."""

    total: SpecTally = field(default_factory=SpecTally)
    accepted_per_pos: list[int] = field(default_factory=list)
    by_route: dict[str, SpecTally] = field(default_factory=dict)
    by_name: dict[str, SpecTally] = field(default_factory=dict)

    def snapshot(self) -> SpecCounters:
        """A copy to read off the step thread (the dicts are copied in C, whole)."""
        return SpecCounters(
            total=replace(self.total),
            accepted_per_pos=list(self.accepted_per_pos),
            by_route={k: replace(v) for k, v in dict(self.by_route).items()},
            by_name={k: replace(v) for k, v in dict(self.by_name).items()},
        )

    def record(self, route: RouteSpec, proposed: int, accepted: int) -> None:
        self.total.add(proposed, accepted)
        if len(self.accepted_per_pos) < proposed:
            self.accepted_per_pos.extend([0] * (proposed - len(self.accepted_per_pos)))
        for pos in range(accepted):
            self.accepted_per_pos[pos] += 1
        # per kind (bounded: five kinds), and per adapter or composition where the route names one
        self.by_route.setdefault(route.kind, SpecTally()).add(proposed, accepted)
        name = route.name
        if name is not None:
            self.by_name.setdefault(name, SpecTally()).add(proposed, accepted)


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
