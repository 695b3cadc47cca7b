"""`molora dashboards push` against a loopback HTTP stub that answers like Grafana's HTTP API.

No Grafana server can run here, so the stub keeps datasources and dashboards in memory, answers
the documented status codes (404 for an unknown datasource uid, 401 without credentials) and
records every request for the assertions.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from deployments.ops import cli, dashboard, grafana_push

TOKEN = "glsa_test_token"


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class FakeGrafana:
    requests: list[Recorded] = field(default_factory=list)
    datasources: dict[str, dict] = field(default_factory=dict)
    dashboards: dict[str, dict] = field(default_factory=dict)


def _handler(state: FakeGrafana) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # keep pytest output clean
            pass

        def _answer(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _handle(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = json.loads(raw) if raw else None
            state.requests.append(Recorded(self.command, self.path, dict(self.headers), body))
            if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                return self._answer(401, {"message": "Unauthorized"})
            route = (self.command, self.path)
            if self.path.startswith("/api/datasources/uid/"):
                uid = self.path.rsplit("/", 1)[1]
                if uid not in state.datasources:
                    return self._answer(404, {"message": "Data source not found"})
                if self.command == "PUT":
                    state.datasources[uid] = body
                    return self._answer(200, {"message": "Datasource updated", "id": 1})
                return self._answer(200, state.datasources[uid])
            if route == ("POST", "/api/datasources"):
                state.datasources[body["uid"]] = body
                return self._answer(200, {"message": "Datasource added", "id": 1})
            if route == ("POST", "/api/dashboards/db"):
                board = body["dashboard"]
                old = state.dashboards.get(board["uid"])
                if old and not body.get("overwrite"):
                    return self._answer(412, {"status": "version-mismatch"})
                version = (old["version"] + 1) if old else 1
                state.dashboards[board["uid"]] = {**board, "version": version}
                return self._answer(
                    200,
                    {
                        "id": 7,
                        "uid": board["uid"],
                        "url": f"/d/{board['uid']}/molora-serve",
                        "status": "success",
                        "version": version,
                    },
                )
            return self._answer(404, {"message": "Not found"})

        do_GET = do_POST = do_PUT = _handle

    return Handler


@pytest.fixture
def grafana() -> Iterator[tuple[str, FakeGrafana]]:
    state = FakeGrafana()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", state
    finally:
        server.shutdown()
        server.server_close()


def test_push_creates_datasource_then_dashboard(grafana: tuple[str, FakeGrafana]) -> None:
    url, state = grafana
    api = grafana_push.connect(url, TOKEN)
    result = grafana_push.push(
        api, dashboard.dashboard_json(), prometheus_url="http://prometheus:9090"
    )

    assert [(r.method, r.path) for r in state.requests] == [
        ("GET", f"/api/datasources/uid/{grafana_push.DATASOURCE_UID}"),
        ("POST", "/api/datasources"),
        ("POST", "/api/dashboards/db"),
    ]
    assert all(r.headers["Authorization"] == f"Bearer {TOKEN}" for r in state.requests)
    datasource = state.requests[1].body
    assert datasource["type"] == "prometheus"
    assert datasource["url"] == "http://prometheus:9090"
    body = state.requests[2].body
    assert body["overwrite"] is True
    sent = body["dashboard"]
    assert sent["id"] is None
    expected = dashboard.dashboard_json()
    assert sent["panels"] == expected["panels"]
    (variable,) = [v for v in sent["templating"]["list"] if v["type"] == "datasource"]
    assert variable["current"]["value"] == grafana_push.DATASOURCE_UID
    assert result.datasource_created is True
    assert result.dashboard_uid == dashboard.DASHBOARD_UID
    assert result.dashboard_url == f"/d/{dashboard.DASHBOARD_UID}/molora-serve"
    assert result.dashboard_version == 1


def test_second_push_updates_in_place(grafana: tuple[str, FakeGrafana]) -> None:
    url, state = grafana
    api = grafana_push.connect(url, TOKEN)
    board = dashboard.dashboard_json()
    grafana_push.push(api, board, prometheus_url="http://prometheus:9090")
    result = grafana_push.push(api, board, prometheus_url="http://prometheus-2:9090")
    methods = [(r.method, r.path) for r in state.requests[3:]]
    assert methods[1] == ("PUT", f"/api/datasources/uid/{grafana_push.DATASOURCE_UID}")
    assert state.datasources[grafana_push.DATASOURCE_UID]["url"] == "http://prometheus-2:9090"
    assert result.datasource_created is False
    assert result.dashboard_version == 2
    assert len(state.dashboards) == 1


@pytest.fixture
def push(grafana: tuple[str, FakeGrafana], monkeypatch: pytest.MonkeyPatch) -> Any:
    """`molora dashboards push FLAGS` against the fake Grafana, the token in `env`; its exit code."""
    url, _ = grafana

    def run(*flags: str, token: str = TOKEN, env: str = "GRAFANA_TOKEN") -> int:
        monkeypatch.setenv(env, token)
        return cli.main(["dashboards", "push", "--grafana-url", url, *flags])

    return run


def test_cli_push_reads_token_from_env(
    push: Any, grafana: tuple[str, FakeGrafana], capsys: pytest.CaptureFixture[str]
) -> None:
    code = push("--prometheus-url", "http://prometheus:9090", "--folder-uid", "ops")
    assert code == 0
    assert grafana[1].requests[-1].body["folderUid"] == "ops"
    out = capsys.readouterr().out
    assert "datasource molora-prometheus created" in out
    assert f"dashboard {dashboard.DASHBOARD_UID} saved" in out


def test_cli_push_without_datasource_uploads_committed_file(
    push: Any, grafana: tuple[str, FakeGrafana]
) -> None:
    path = dashboard.REPO_ROOT / dashboard.DASHBOARD_PATH
    flags = ("--no-datasource", "--dashboard", str(path))
    assert push("--token-env", "MY_TOKEN", *flags, env="MY_TOKEN") == 0
    requests = grafana[1].requests
    assert [(r.method, r.path) for r in requests] == [("POST", "/api/dashboards/db")]
    assert requests[0].body["dashboard"]["panels"] == json.loads(path.read_text())["panels"]


def test_cli_push_reports_refusal(push: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert push(token="wrong") == 1
    assert "Grafana refused" in capsys.readouterr().err


def test_cli_build_writes_the_committed_json(tmp_path: Path) -> None:
    out = tmp_path / "board.json"
    assert cli.main(["dashboards", "build", "--out", str(out)]) == 0
    assert json.loads(out.read_text()) == dashboard.dashboard_json()
