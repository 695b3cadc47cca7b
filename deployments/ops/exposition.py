"""Prometheus text from Ray's exporters -> the API port's /metrics: our families only, vLLM's
names, private catalog names replaced.

Ray's exporter on each node serves every process's series with Ray's `ray_` prefix and Ray's
own metrics beside them. The API port serves only the project's families (`molora_*`, and
`vllm_*` renamed `vllm:*`), merged over nodes, with every label value that names a tenant's
private adapter or composition replaced by `private`, and Ray's per-process bookkeeping labels
dropped (series that then coincide are summed).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

from deployments.access.tenancy import PRIVATE_LABEL
from deployments.ops.metric_names import PROMETHEUS_PREFIX, api_name

KEPT_PREFIXES = (PROMETHEUS_PREFIX + "molora_", PROMETHEUS_PREFIX + "vllm_")
NAME_LABELS = ("adapter", "composition", "lora_name")  # labels that may carry a catalog name
# Ray's per-process bookkeeping labels: dropped here (deployment, replica and node stay)
DROPPED_LABELS = frozenset(
    {
        "Component", "SessionName", "Version", "WorkerId", "otel_scope_name",
        "otel_scope_schema_url", "otel_scope_version",
    }
)  # fmt: skip
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


class _Family:
    def __init__(self, name: str) -> None:
        self.name = name
        self.help = ""
        self.type = "untyped"
        self.samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}


def _public(labels: list[tuple[str, str]], private: frozenset[str]) -> tuple[tuple[str, str], ...]:
    out = []
    for key, value in labels:
        if key in DROPPED_LABELS:
            continue
        if key in NAME_LABELS and value.partition("@")[0] in private:
            value = PRIVATE_LABEL
        out.append((key, value))
    return tuple(out)


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
            current.samples[key] = current.samples.get(key, 0.0) + value
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
