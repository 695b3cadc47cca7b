"""Upload the MoLoRA dashboard and its Prometheus datasource to a Grafana server.

Uses `grafana-client` (maintained; `grafana-api` has had no release since 2020). Both uploads are
idempotent: the datasource is created or updated by a fixed uid, the dashboard is saved with
`overwrite`, so running the push again after an upgrade just refreshes them.
"""

from __future__ import annotations

import copy
from typing import Any

from grafana_client import GrafanaApi
from grafana_client.client import GrafanaClientError
from pydantic import BaseModel, ConfigDict, Field

DATASOURCE_UID = "molora-prometheus"
DATASOURCE_NAME = "MoLoRA Prometheus"
DATASOURCE_VARIABLE = "datasource"


class PushResult(BaseModel):
    """What Grafana answered, for the command line to print."""

    model_config = ConfigDict(extra="forbid")

    datasource_uid: str | None = Field(None, description="None when no datasource was pushed")
    datasource_created: bool = False
    dashboard_uid: str
    dashboard_url: str
    dashboard_version: int | None = None


def datasource_payload(prometheus_url: str) -> dict[str, Any]:
    """The Prometheus datasource the dashboard's `datasource` variable points at by default."""
    return {
        "uid": DATASOURCE_UID,
        "name": DATASOURCE_NAME,
        "type": "prometheus",
        "access": "proxy",
        "url": prometheus_url,
        "isDefault": False,
        "jsonData": {"httpMethod": "POST", "timeInterval": "15s"},
    }


def select_datasource(dashboard: dict[str, Any], uid: str, name: str) -> dict[str, Any]:
    """A copy of `dashboard` whose datasource variable starts on datasource `uid`."""
    dashboard = copy.deepcopy(dashboard)
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "datasource" and variable.get("name") == DATASOURCE_VARIABLE:
            variable["current"] = {"selected": True, "text": name, "value": uid}
    return dashboard


def upsert_datasource(api: GrafanaApi, payload: dict[str, Any]) -> bool:
    """Create the datasource, or update it in place when its uid exists; True if created."""
    try:
        api.datasource.get_datasource_by_uid(payload["uid"])
    except GrafanaClientError as exc:
        if exc.status_code != 404:
            raise
        api.datasource.create_datasource(payload)
        return True
    api.datasource.update_datasource_by_uid(payload["uid"], payload)
    return False


def push(
    api: GrafanaApi,
    dashboard: dict[str, Any],
    *,
    prometheus_url: str | None = None,
    folder_uid: str | None = None,
    message: str = "molora dashboards push",
) -> PushResult:
    """Upload the datasource (when `prometheus_url` is given) and then the dashboard."""
    datasource_uid = None
    created = False
    if prometheus_url:
        payload = datasource_payload(prometheus_url)
        created = upsert_datasource(api, payload)
        datasource_uid = payload["uid"]
        dashboard = select_datasource(dashboard, datasource_uid, payload["name"])
    dashboard = {**dashboard, "id": None}  # let Grafana match by uid, never by a foreign id
    body: dict[str, Any] = {"dashboard": dashboard, "overwrite": True, "message": message}
    if folder_uid:
        body["folderUid"] = folder_uid
    answer = api.dashboard.update_dashboard(body)
    return PushResult(
        datasource_uid=datasource_uid,
        datasource_created=created,
        dashboard_uid=answer.get("uid", dashboard["uid"]),
        dashboard_url=answer.get("url", ""),
        dashboard_version=answer.get("version"),
    )


def connect(url: str, token: str | None, timeout: float = 10.0) -> GrafanaApi:
    """A client for `url`; `token` is a service-account token, else credentials in the URL."""
    return GrafanaApi.from_url(url, credential=token or None, timeout=timeout)
