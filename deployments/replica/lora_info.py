"""What a model replica tells users' tools about its adapters, as label values with a bound.

- vLLM's `lora_requests_info` gauge, which the Kubernetes Gateway API Inference Extension's
  endpoint picker reads for LoRA affinity: `running_lora_adapters` and `waiting_lora_adapters`
  (comma-separated names of the adapters the running / waiting requests asked for) and `max_lora`
  (the hot-set's slot count); its value is the Unix time of the update, since the picker takes
  the series with the newest value.
- `molora_adapter_residency`: which adapters sit in a hot-set slot or parsed in host memory,
  with rank and pin, one row per (name, tier, rank, pinned) whose value counts the adapters.

Names are shown as vLLM shows a LoRA name: the plain name, no `@version`. A tenant's adapter
(a namespaced store name, `tenant~name`) is never named: it reads `private`, as on every other
metric; the API port's /metrics also hides a tenant's pre-namespace plain names
(`exposition.merge`). Lists are cut after `MAX_LISTED` names (most requests first) and end with
`+N` for the N more; the host tier names at most `MAX_HOST_ROWS` adapters, the rest `+other`. So
the label values a replica can produce are bounded by its slots and these caps, not by the
catalog or the traffic.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Literal, NamedTuple

from adapter_store.names import NAMESPACE_SEP
from deployments.access.tenancy import PRIVATE_LABEL
from deployments.placement.affinity import base_name

MAX_LISTED = 16  # names per lora_requests_info list, then "+N"
MAX_HOST_ROWS = 64  # host-tier adapters named in molora_adapter_residency, then "+other"
OTHER = "+other"  # no adapter name has a '+': it cannot collide with one
UNKNOWN_RANK = "unknown"  # a host-tier adapter whose weights this replica never read into a slot

Tier = Literal["slot", "host"]


def namespaced(ref: str) -> bool:
    """Whether `ref` is a tenant's namespaced store name (`tenant~name`)."""
    return NAMESPACE_SEP in base_name(ref)


def public_name(ref: str, private: Callable[[str], bool] = namespaced) -> str:
    """The label for adapter or composition `ref`: its plain name without `@version`, or
    `private` for a tenant's adapter (`private` tells which: by default its namespaced name)."""
    return PRIVATE_LABEL if private(ref) else base_name(ref)


def adapter_list(
    counts: Mapping[str, int], cap: int = MAX_LISTED, private: Callable[[str], bool] = namespaced
) -> str:
    """`counts` (ref -> requests) as vLLM's comma-separated list: public names, no spaces (the
    picker splits on ',' only), the most requested first, at most `cap`, then `+N`."""
    merged: dict[str, int] = {}
    for ref, n in counts.items():
        name = public_name(ref, private)
        merged[name] = merged.get(name, 0) + n
    order = sorted(merged, key=lambda name: (-merged[name], name))
    shown, rest = order[:cap], len(order) - cap
    return ",".join([*shown, f"+{rest}"] if rest > 0 else shown)


def lora_info_tags(
    running: Mapping[str, int],
    waiting: Mapping[str, int],
    num_slots: int,
    private: Callable[[str], bool] = namespaced,
) -> dict[str, str]:
    """The labels of one `lora_requests_info` update (vLLM's names)."""
    return {
        "max_lora": str(num_slots),
        "running_lora_adapters": adapter_list(running, private=private),
        "waiting_lora_adapters": adapter_list(waiting, private=private),
    }


class ResidencyRow(NamedTuple):
    """One `molora_adapter_residency` series: its labels."""

    adapter: str
    tier: Tier
    rank: str
    pinned: str


def residency_rows(
    slots: Iterable[str],
    host: Iterable[str],
    pinned: Iterable[str],
    ranks: Mapping[str, int],
    host_cap: int = MAX_HOST_ROWS,
    private: Callable[[str], bool] = namespaced,
) -> dict[ResidencyRow, int]:
    """Rows of the adapters in a slot (`slots`, every one: the slot count bounds them) and of
    those parsed in host memory but in no slot (`host`, the first `host_cap` named, the rest
    `+other`), each counting the adapters it stands for (versions of one name, tenants'
    adapters and the overflow share a row)."""
    rows: dict[ResidencyRow, int] = {}
    held, pins = set(slots), set(pinned)

    def add(ref: str, tier: Tier, name: str | None = None) -> None:
        rank = ranks.get(ref)
        row = ResidencyRow(
            adapter=name or public_name(ref, private),
            tier=tier,
            rank=UNKNOWN_RANK if rank is None else str(rank),
            pinned="true" if ref in pins else "false",
        )
        rows[row] = rows.get(row, 0) + 1

    for ref in sorted(held):
        add(ref, "slot")
    for i, ref in enumerate(sorted(set(host) - held)):
        add(ref, "host", None if i < host_cap else OTHER)
    return rows
