"""The gate PrometheusRule: a valid object in the kustomize build, accepted by `promtool`, and
firing (in promtool's own rule evaluation) on a collapsed gate and a shift, never on a healthy one."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from deployments.ops import gate_alerts
from deployments.telemetry import metric_names as m
from tests.k8s.k8s_schemas import REPO, kustomize_build, operator_object, strict

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed")
TOP1 = m.scraped(m.GATE_TOP1_TOKENS)
ENT_SUM = m.scraped(m.GATE_ENTROPY_SUM)
ENT_BUCKETS = m.scraped(m.GATE_ENTROPY_BUCKETS)

# The fields of monitoring.coreos.com/v1 PrometheusRule we use, strict.
ALERT = strict(
    {
        "alert": {"type": "string"},
        "expr": {"type": "string"},
        "for": {"type": "string", "pattern": "^[0-9]+(s|m|h)$"},
        "labels": {"type": "object"},
        "annotations": {"type": "object"},
    },
    required=["alert", "expr"],
)
GROUP = strict(
    {"name": {"type": "string"}, "rules": {"type": "array", "items": ALERT}},
    required=["name", "rules"],
)
RULE_SCHEMA = operator_object(
    "PrometheusRule",
    strict({"groups": {"type": "array", "items": GROUP}}, required=["groups"]),
    metadata={"type": "object", "required": ["name"]},
)


@pytest.mark.parametrize("overlay", [REPO / "k8s" / "base", REPO / "k8s" / "overlays" / "dev"])
def test_rule_is_in_the_build_and_valid(overlay: Path) -> None:
    (rule,) = [o for o in kustomize_build(overlay) if o["kind"] == "PrometheusRule"]
    jsonschema.validate(rule, RULE_SCHEMA)
    assert rule["spec"]["groups"] == gate_alerts.rule_groups()


def test_rule_queries_only_exported_metrics() -> None:
    exported = {m.scraped(name) for name in m.ALL}
    for group in gate_alerts.rule_groups():
        for rule in group["rules"]:
            used = {w for w in rule["expr"].replace("(", " ").replace("[", " ").split()}
            used = {w.split("{")[0] for w in used if w.startswith("ray_")}
            assert used and used <= exported, rule["alert"]


def _rules_file(tmp_path: Path) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": gate_alerts.rule_groups()}))
    return path


@needs_promtool
def test_promtool_checks_the_rules(tmp_path: Path) -> None:
    out = subprocess.run(
        [PROMTOOL, "check", "rules", str(_rules_file(tmp_path))], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


def _series(comp: str, adapter: str, values: str) -> dict[str, str]:
    labels = f'composition="{comp}", layer="0", adapter="{adapter}"'
    return {"series": f"{TOP1}{{{labels}}}", "values": values}


def _entropy(comp: str, per_min_sum: str, per_min_tokens: str) -> list[dict[str, str]]:
    base = f'composition="{comp}", layer="0"'
    return [
        {"series": f"{ENT_SUM}{{{base}}}", "values": per_min_sum},
        {"series": f'{ENT_BUCKETS}{{{base}, le="+Inf"}}', "values": per_min_tokens},
    ]


def _alert(name: str, comp: str, severity: str, value: str) -> dict:
    """What promtool must see firing: labels and the rendered annotations."""
    texts = {
        "MoloraGateCollapsed": (
            f"Learned gate of {comp} collapsed",
            f"One expert is ranked first for more than 95% of the tokens of composition {comp} "
            f"over 15m ({value}): the mixture serves as one adapter.",
        ),
        "MoloraGateShift": (
            f"Routing of {comp} shifted",
            f"An expert's share of first-ranked tokens moved by {value} against the same window "
            "1h earlier: traffic or the gate changed.",
        ),
        "MoloraGateEntropyShift": (
            f"Gate entropy of {comp} shifted",
            f"Mean normalized routing entropy moved by {value} against the same window 1h earlier.",
        ),
    }
    summary, description = texts[name]
    return {
        "exp_labels": {"composition": comp, "severity": severity},
        "exp_annotations": {"summary": summary, "description": description},
    }


@needs_promtool
def test_alerts_fire_on_collapse_and_shift_only(tmp_path: Path) -> None:
    """solo: one expert takes 99% (collapsed); duo: 50/50 throughout (healthy); drift: 50/50
    for 75 minutes, then 90/10 with a colder gate (a shift of share and of entropy, seen while
    the lookback window still holds the old routing)."""
    series = [
        _series("solo", "a", "0+990x150"),
        _series("solo", "b", "0+10x150"),
        _series("duo", "a", "0+500x150"),
        _series("duo", "b", "0+500x150"),
        _series("drift", "a", "0+500x75 38400+900x75"),
        _series("drift", "b", "0+500x75 37600+100x75"),
        *_entropy("solo", "0+50x150", "0+1000x150"),
        *_entropy("duo", "0+900x150", "0+1000x150"),
        *_entropy("drift", "0+900x75 67700+200x75", "0+1000x75 76000+1000x75"),
    ]
    tests = [
        ("60m", "MoloraGateCollapsed", [_alert("MoloraGateCollapsed", "solo", "warning", "99%")]),
        ("60m", "MoloraGateShift", []),  # nothing changed yet
        ("60m", "MoloraGateEntropyShift", []),
        ("100m", "MoloraGateShift", [_alert("MoloraGateShift", "drift", "info", "40%")]),
        (
            "100m",
            "MoloraGateEntropyShift",
            [_alert("MoloraGateEntropyShift", "drift", "info", "0.70")],
        ),
        ("150m", "MoloraGateShift", []),  # both windows after the change: the new normal
    ]
    alerts = [{"eval_time": t, "alertname": n, "exp_alerts": exp} for t, n, exp in tests]
    test = {
        "rule_files": [str(_rules_file(tmp_path))],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": alerts}],
    }
    path = tmp_path / "test.yaml"
    path.write_text(yaml.safe_dump(test))
    out = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
