"""The rules for adding one expert to a published composition, and the version it publishes as.

A composition grows by one expert without retraining the rest: its adapters, base model and old
gate rows stay as they are, so the new expert must fit them (same base model, same rank as the
experts it joins, not already one of them), and the grown gates are a new immutable version.
"""

from __future__ import annotations

import re

from adapter_store.errors import InvalidInputError
from adapter_store.manifest import AdapterManifest, CompositionManifest
from adapter_store.names import parse_ref

NUMBERED_VERSION = re.compile(r"v(\d+)")


def check_new_expert(
    composition: CompositionManifest,
    expert: AdapterManifest,
    members: list[AdapterManifest],
) -> None:
    """Refuse an expert that the composition `composition` (whose pinned adapters are
    `members`) cannot take: a duplicate, another base model, or another rank."""
    names = [parse_ref(ref).name for ref in composition.adapters]
    if expert.name in names:
        raise InvalidInputError(
            f"adapter {expert.name!r} is already expert {names.index(expert.name) + 1} of "
            f"composition {composition.ref}; a composition lists each adapter once"
        )
    if expert.base_model != composition.base_model:
        raise InvalidInputError(
            f"adapter {expert.ref} is for base model {expert.base_model!r}, but composition "
            f"{composition.ref} is over {composition.base_model!r}"
        )
    ranks = sorted({m.rank for m in members})
    if expert.rank not in ranks:
        have = ", ".join(f"{m.ref} r={m.rank}" for m in members)
        raise InvalidInputError(
            f"adapter {expert.ref} has rank {expert.rank}; composition {composition.ref}'s "
            f"experts have rank {'/'.join(map(str, ranks))} ({have}): retrain it at that rank"
        )


def next_version(versions: list[str]) -> str:
    """`v<N+1>` after the highest `v<N>` of `versions` (`v1` for none); other schemes are
    ambiguous, so the caller must name the version."""
    numbers = []
    for version in versions:
        match = NUMBERED_VERSION.fullmatch(version)
        if match is None:
            raise InvalidInputError(
                f"version {version!r} is not of the form v<N>, so the next one is not "
                "implied: pass --version"
            )
        numbers.append(int(match.group(1)))
    return f"v{max(numbers, default=0) + 1}"
