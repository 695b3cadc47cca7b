"""Speculative decoding's acceptance counters, totals and per draft position, route kind and
name, as the stats and the metrics report them."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from molora_runtime.routes import RouteSpec


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
