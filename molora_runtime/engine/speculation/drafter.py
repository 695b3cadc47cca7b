"""The drafter: proposes each decoding sequence's draft from its own history (and, with `suffix`,
its route's recent answers; with `eagle`, from a learned head over the target's last hidden
state), and adapts how many tokens it drafts to what was accepted."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from molora_runtime.config import SpeculativeConfig
from molora_runtime.engine.speculation.draft_head import DraftHead, load_head
from molora_runtime.engine.speculation.ngram_index import SEPARATOR, NgramIndex
from molora_runtime.engine.speculation.route_memory import RouteMemory
from molora_runtime.engine.speculation.spec_counters import SpecCounters
from molora_runtime.model.decoder import CausalLM
from molora_runtime.routes import RouteSpec

ROUTE_MEMORIES = 256  # (tenant, route) memories kept, least recently used dropped


@dataclass
class SpecState:
    """One sequence's proposer state: its history's index, how many tokens it drafts, and
    the (tenant, route) whose memory it drafts from and adds its answer to."""

    index: NgramIndex
    k: int
    memory_key: tuple[str | None, str]
    head: DraftHead | None = None  # eagle: the head this sequence's route drafts with
    feature: torch.Tensor | None = None  # eagle: the target's hidden state at `feature_pos`
    feature_pos: int = -1


class Drafter:
    """Proposes each decoding sequence's draft and learns from what was accepted."""

    def __init__(self, config: SpeculativeConfig, target: CausalLM | None = None) -> None:
        """`target`: the served model, whose embedding, final norm and LM head an `eagle` head
        drafts through (needed for `eagle` only)."""
        self.config = config
        self.lo, self.hi = config.prompt_lookup_min, config.prompt_lookup_max
        self.counters = SpecCounters()
        self._memories: OrderedDict[tuple[str | None, str], RouteMemory] = OrderedDict()
        self.target = target
        self.shared_head: DraftHead | None = None
        self.adapter_heads: dict[str, DraftHead] = {}
        if config.method == "eagle":
            if target is None or config.model is None:
                raise ValueError("the eagle method needs the served model and a head")
            self.shared_head = load_head(config.model, target)
            self.adapter_heads = {a: load_head(p, target) for a, p in config.draft_heads.items()}

    def observe(self, state: SpecState, position: int, feature: torch.Tensor) -> None:
        """The target's hidden state at `position` of the sequence (the row that sampled the
        token after it): where the next eagle draft starts from (a copy: the step's rows go)."""
        state.feature, state.feature_pos = feature.clone(), position

    def active(self, decoding: int) -> bool:
        """Whether a step with `decoding` sequences speculates at all."""
        return 0 < decoding <= self.config.max_batch

    def propose(self, state: SpecState, history: list[int]) -> list[int]:
        """Up to `state.k` tokens that followed the latest earlier occurrence of the longest
        n-gram ending `history` (eagle: the head's roll-out from the target's hidden state
        of the token before the last); [] when nothing matches."""
        if state.head is not None:
            return self._roll_out(state, history)
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

    def _roll_out(self, state: SpecState, history: list[int]) -> list[int]:
        """The head's k tokens after `history`, from the hidden state of the row that sampled
        its last token; [] when that row's state is not the one held (e.g. after a preemption
        before its recompute sampled again)."""
        if state.feature is None or state.feature_pos != len(history) - 2:
            return []
        assert state.head is not None and self.target is not None
        return state.head.roll_out(self.target, state.feature, history[-1], state.k)

    def new_state(self, tenant: str | None, route: RouteSpec) -> SpecState:
        key = (tenant, route.model_dump_json())
        state = SpecState(NgramIndex(self.lo, self.hi), self.config.num_speculative_tokens, key)
        if self.shared_head is not None:
            state.head = self._head_for(route)
        return state

    def _head_for(self, route: RouteSpec) -> DraftHead | None:
        """The own head of the one adapter (or composition) the route stands for, by
        `name@version`, else by name; else the shared one."""
        name, heads = route.name, self.adapter_heads
        own = None if name is None else heads.get(name, heads.get(name.partition("@")[0]))
        return own if own is not None else self.shared_head

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
