"""The Grafana dashboard: committed JSON is fresh, schema-valid, and queries only real metrics."""

from __future__ import annotations

import json

import jsonschema
from grafana_foundation_sdk.models.dashboard import Dashboard

from deployments.ops import dashboard
from tests.k8s.dashboard_queries import exported_names, metric_names, targets
from tests.k8s.k8s_schemas import REPO

COMMITTED = REPO / dashboard.DASHBOARD_PATH

_REF = {"$ref": "#/definitions/datasource"}
_GRID = {
    "type": "object",
    "required": ["h", "w", "x", "y"],
    "additionalProperties": False,
    "properties": {
        "h": {"type": "integer", "minimum": 1},
        "w": {"type": "integer", "minimum": 1, "maximum": 24},
        "x": {"type": "integer", "minimum": 0, "maximum": 23},
        "y": {"type": "integer", "minimum": 0},
    },
}
# Grafana's dashboard JSON model (schemaVersion 41, Grafana 11) for the fields this dashboard
# uses; unknown top-level fields are rejected so a misspelt key cannot slip through.
DASHBOARD_SCHEMA = {
    "type": "object",
    "required": ["uid", "title", "schemaVersion", "panels", "templating", "annotations"],
    "additionalProperties": False,
    "definitions": {
        "datasource": {
            "type": "object",
            "required": ["type", "uid"],
            "additionalProperties": False,
            "properties": {"type": {"const": "prometheus"}, "uid": {"type": "string"}},
        },
        "target": {
            "type": "object",
            "required": ["expr", "refId", "datasource"],
            "properties": {
                "expr": {"type": "string", "minLength": 1},
                "refId": {"type": "string", "pattern": "^[A-Z]$"},
                "legendFormat": {"type": "string"},
                "range": {"type": "boolean"},
                "instant": {"type": "boolean"},
                "datasource": _REF,
            },
        },
        "panel": {
            "type": "object",
            "required": ["type", "id", "title", "gridPos", "targets", "datasource"],
            "properties": {
                "type": {"enum": ["timeseries", "stat"]},
                "id": {"type": "integer", "minimum": 1},
                "title": {"type": "string", "minLength": 1},
                "description": {"type": "string"},
                "gridPos": _GRID,
                "datasource": _REF,
                "targets": {
                    "type": "array",
                    "minItems": 1,
                    "items": {"$ref": "#/definitions/target"},
                },
                "fieldConfig": {
                    "type": "object",
                    "required": ["defaults", "overrides"],
                    "properties": {
                        "defaults": {"type": "object", "required": ["unit"]},
                        "overrides": {"type": "array"},
                    },
                },
                "options": {"type": "object"},
            },
        },
        "row": {
            "type": "object",
            "required": ["type", "id", "title", "gridPos", "collapsed", "panels"],
            "properties": {
                "type": {"const": "row"},
                "id": {"type": "integer", "minimum": 1},
                "title": {"type": "string", "minLength": 1},
                "gridPos": _GRID,
                "collapsed": {"type": "boolean"},
                "panels": {"type": "array", "maxItems": 0},
            },
        },
    },
    "properties": {
        "uid": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,40}$"},
        "title": {"type": "string"},
        "description": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "timezone": {"type": "string"},
        "editable": {"type": "boolean"},
        "graphTooltip": {"enum": [0, 1, 2]},
        "time": {
            "type": "object",
            "required": ["from", "to"],
            "properties": {"from": {"type": "string"}, "to": {"type": "string"}},
        },
        "fiscalYearStartMonth": {"type": "integer"},
        "refresh": {"type": "string", "pattern": "^[0-9]+[smhd]$"},
        "schemaVersion": {"type": "integer", "minimum": 39},
        "annotations": {"type": "object"},
        "templating": {
            "type": "object",
            "required": ["list"],
            "properties": {
                "list": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["type", "name"],
                        "properties": {
                            "type": {"enum": ["datasource", "query"]},
                            "name": {"type": "string", "pattern": "^[a-z_]+$"},
                        },
                    },
                }
            },
        },
        "panels": {
            "type": "array",
            "items": {"anyOf": [{"$ref": "#/definitions/row"}, {"$ref": "#/definitions/panel"}]},
        },
    },
}


def test_committed_json_is_fresh() -> None:
    assert COMMITTED.read_text() == dashboard.render(dashboard.dashboard_json()), (
        "run `molora dashboards build` and commit k8s/grafana/molora-dashboard.json"
    )


def test_dashboard_validates_against_schema() -> None:
    board = json.loads(COMMITTED.read_text())
    jsonschema.validate(board, DASHBOARD_SCHEMA)
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"


def test_sdk_model_roundtrip() -> None:
    """The committed JSON decodes into the SDK's Dashboard model and encodes back unchanged."""
    board = json.loads(COMMITTED.read_text())
    again = json.loads(json.dumps(Dashboard.from_json(board).to_json(), default=_encode))
    assert again == board


def _encode(obj: object) -> object:
    return obj.to_json()  # type: ignore[attr-defined]


def test_panels_do_not_overlap() -> None:
    board = json.loads(COMMITTED.read_text())
    cells: set[tuple[int, int]] = set()
    for panel in board["panels"]:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not (mine & cells), f"{panel['title']} overlaps another panel"
        cells |= mine


def test_every_query_names_an_exported_metric() -> None:
    exported = exported_names()
    for target in targets(dashboard.dashboard_json()):
        used = metric_names(target["expr"])
        assert used, f"no metric in {target['expr']}"
        assert used <= exported, f"unknown metric(s) {used - exported} in {target['expr']}"


def test_every_project_metric_has_a_panel() -> None:
    """The issue's list: requests, tokens, TTFT, ITL, queue, hot-set, gate, replicas/autoscaling."""
    used = set().union(*(metric_names(t["expr"]) for t in targets(dashboard.dashboard_json())))
    assert used == exported_names()


def test_variables_feed_every_query() -> None:
    board = dashboard.dashboard_json()
    names = {v["name"] for v in board["templating"]["list"]}
    assert names == {"datasource", "application", "adapter"}
    for target in targets(board):
        assert target["datasource"]["uid"] == "${datasource}"
        assert '$application"' in target["expr"]
