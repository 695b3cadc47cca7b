"""Prometheus text from Ray's exporters -> the API port's /metrics: our families only, vLLM's
names, private catalog names replaced.

Ray's exporter on each node serves every process's series with Ray's `ray_` prefix and Ray's
own metrics beside them. The API port serves only the project's families (`molora_*`, and
`vllm_*` renamed `vllm:*`), merged over nodes, with every label value that names a tenant's
private adapter or composition replaced by `private` (each name of a comma-separated adapter
list too), and Ray's per-process bookkeeping labels dropped (series that then coincide are
summed).

vLLM's `lora_requests_info` is a gauge whose value is the time of its update and whose labels
are the adapter lists: Ray keeps an old label set on a node's exporter for a while after the
replica moved on, so only each replica's newest series is served (what the endpoint picker
would pick anyway), and coinciding series keep the newest time rather than a meaningless sum.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

from deployments.access.tenancy import PRIVATE_LABEL
from deployments.telemetry.metric_names import PROMETHEUS_PREFIX, VLLM_LORA_INFO, api_name

KEPT_PREFIXES = (PROMETHEUS_PREFIX + "molora_", PROMETHEUS_PREFIX + "vllm_")
NAME_LABELS = ("adapter", "composition", "lora_name")  # labels that may carry a catalog name
LIST_LABELS = ("running_lora_adapters", "waiting_lora_adapters")  # comma-separated names
# families whose value is an update time and whose labels (these) change with each update: only
# the newest series per remaining label set is kept
NEWEST_ONLY = {PROMETHEUS_PREFIX + VLLM_LORA_INFO: (*LIST_LABELS, "max_lora")}
# Ray's per-process bookkeeping labels: dropped here (deployment, replica and node stay)
DROPPED_LABELS = frozenset(
    {
        "Component", "SessionName", "Version", "WorkerId", "otel_scope_name",
        "otel_scope_schema_url", "otel_scope_version",
    }
)  # fmt: skip
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


Labels = tuple[tuple[str, str], ...]
SampleKey = tuple[str, Labels]  # (sample name, labels)


class _Family:
    def __init__(self, name: str) -> None:
        self.name = name
        self.help = ""
        self.type = "untyped"
        self.samples: dict[SampleKey, float] = {}


def _public(labels: list[tuple[str, str]], private: frozenset[str]) -> Labels:
    out = []
    for key, value in labels:
        if key in DROPPED_LABELS:
            continue
        if key in NAME_LABELS and value.partition("@")[0] in private:
            value = PRIVATE_LABEL
        elif key in LIST_LABELS and value:
            names = (
                PRIVATE_LABEL if n.partition("@")[0] in private else n for n in value.split(",")
            )
            value = ",".join(dict.fromkeys(names))
        out.append((key, value))
    return tuple(out)


def _newest_only(family: _Family, varying: tuple[str, ...]) -> None:
    """Keep, per label set without the `varying` labels, the sample with the largest value."""
    newest: dict[SampleKey, tuple[SampleKey, float]] = {}
    for key, value in family.samples.items():
        sample, labels = key
        identity = (sample, tuple(kv for kv in labels if kv[0] not in varying))
        if identity not in newest or value > newest[identity][1]:
            newest[identity] = (key, value)
    family.samples = dict(newest.values())


def _rename(name: str) -> str:
    return api_name(name.removeprefix(PROMETHEUS_PREFIX))


def merge(texts: Iterable[str], private: frozenset[str] = frozenset()) -> str:
    """Our families from several exporters' texts as one exposition (see the module doc)."""
    families: dict[str, _Family] = {}
    current: _Family | None = None
    for text in texts:
        current = None
        for line in text.splitlines():
            if line.startswith("#"):
                parts = line.split(" ", 3)
                if len(parts) < 3 or parts[1] not in ("HELP", "TYPE"):
                    continue
                name = parts[2]
                if not name.startswith(KEPT_PREFIXES):
                    current = None
                    continue
                current = families.setdefault(name, _Family(name))
                value = parts[3] if len(parts) > 3 else ""
                if parts[1] == "HELP":
                    current.help = value
                else:
                    current.type = value
                continue
            match = _SAMPLE.match(line)
            if current is None or match is None or not match.group(1).startswith(current.name):
                continue
            labels = _public(_LABEL.findall(match.group(3) or ""), private)
            try:
                value = float(match.group(4))
            except ValueError:
                continue
            key = (match.group(1), labels)
            if key in current.samples and current.name in NEWEST_ONLY:
                value = max(value, current.samples[key])
            elif key in current.samples:
                value += current.samples[key]
            current.samples[key] = value
    for name, varying in NEWEST_ONLY.items():
        if name in families:
            _newest_only(families[name], varying)
    return render(families.values())


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


def render(families: Iterable[_Family]) -> str:
    """Families in the text format, HELP and TYPE once each, names as the API port shows them."""
    lines: list[str] = []
    for family in families:
        if not family.samples:
            continue
        name = _rename(family.name)
        lines.append(f"# HELP {name} {family.help}")
        lines.append(f"# TYPE {name} {family.type}")
        for (sample, labels), value in family.samples.items():
            body = ",".join(f'{k}="{v}"' for k, v in labels)  # values kept as escaped
            lines.append(f"{_rename(sample)}{{{body}}} {_number(value)}")
    return "\n".join(lines) + "\n" if lines else ""
