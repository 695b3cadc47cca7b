"""The MoLoRA Grafana dashboard, built in code so every query names a metric we really export.

Queries are written from the constants in `deployments.telemetry.metric_names` (plus Ray Serve's own
replica and autoscaling gauges), never typed by hand, so a renamed metric breaks the build and the
tests instead of silently emptying a panel. `molora dashboards build` writes the JSON that is
committed under `k8s/grafana/`; `molora dashboards push` uploads it.
"""

from __future__ import annotations

import json
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard as dash_b
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as dash_m

from deployments.ops import (
    dashboard_rows_adapters,
    dashboard_rows_cluster,
    dashboard_rows_gates,
    dashboard_rows_serving,
    dashboard_rows_vllm,
)
from deployments.ops.dashboard_panels import DATASOURCE, Row, build
from deployments.telemetry import metric_names as m

DASHBOARD_UID = "molora-serve"
DASHBOARD_TITLE = "MoLoRA Serve"
REPO_ROOT = Path(__file__).resolve().parents[2]
DASHBOARD_PATH = Path("k8s") / "grafana" / "molora-dashboard.json"
# Each concern's rows, top to bottom; a new concern is a new `dashboard_rows_*` module listed here.
ROW_MODULES = (
    dashboard_rows_serving,
    dashboard_rows_adapters,
    dashboard_rows_gates,
    dashboard_rows_cluster,
    dashboard_rows_vllm,
)


def _rows() -> list[Row]:
    return [row for module in ROW_MODULES for row in module.rows()]


def _label_variable(name: str, label: str) -> dash_b.QueryVariable:
    """A multi-select variable over the values of one label of the requests counter."""
    return (
        dash_b.QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query(f"label_values({m.scraped(m.REQUESTS)}, {name})")
        .refresh(dash_m.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .include_all(True)
        .all_value(".*")
        .multi(True)
    )


def _variables() -> list[dash_b.DatasourceVariable | dash_b.QueryVariable]:
    datasource = dash_b.DatasourceVariable("datasource").label("Prometheus").type("prometheus")
    return [
        datasource,
        _label_variable("application", "Serve application"),
        _label_variable("adapter", "Adapter"),
    ]


def build_dashboard() -> dash_m.Dashboard:
    """The dashboard model (grafana-foundation-sdk), rows laid out top to bottom."""
    builder = (
        dash_b.Dashboard(DASHBOARD_TITLE)
        .uid(DASHBOARD_UID)
        .description("Requests, latency, adapter hot-set, learned router and autoscaling.")
        .tags(["molora", "ray-serve", "llm"])
        .refresh("30s")
        .time("now-1h", "now")
        .timezone("browser")
        .tooltip(dash_m.DashboardCursorSync.CROSSHAIR)
        .variables(_variables())
    )
    panel_id = 0
    for title, panels in _rows():
        panel_id += 1
        builder = builder.with_row(dash_b.Row(title).id(panel_id))
        for panel in panels:
            panel_id += 1
            builder = builder.with_panel(build(panel).id(panel_id))
    return builder.build()


def dashboard_json() -> dict:
    """The dashboard as the plain JSON object Grafana stores."""
    return json.loads(json.dumps(build_dashboard(), cls=JSONEncoder))


def render(dashboard: dict) -> str:
    """Stable text form (sorted keys, trailing newline) so the committed file diffs cleanly."""
    return json.dumps(dashboard, indent=2, sort_keys=True) + "\n"


def write(path: Path) -> Path:
    """Write the dashboard JSON to `path` (parents created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(dashboard_json()))
    return path
