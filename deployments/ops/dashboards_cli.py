"""`molora dashboards build|push`: the observability commands.

Only `deployments.ops.cli` imports this, lazily; Grafana libraries load when a command runs, so a
missing `ops` extra never breaks the other sub-commands.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

TOKEN_ENV = "GRAFANA_TOKEN"
# The Prometheus Operator's governing Service (kube-prometheus-stack in `monitoring`).
DEFAULT_PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"


def _build(args: argparse.Namespace) -> int:
    from deployments.ops import dashboard  # grafana-foundation-sdk: the optional `ops` extra

    out = dashboard.write(Path(args.out))
    print(f"wrote {out}")
    return 0


def _load(path: str | None) -> dict:
    from deployments.ops import dashboard  # grafana-foundation-sdk: the optional `ops` extra

    if path is None:
        return dashboard.dashboard_json()
    return json.loads(Path(path).read_text())


def _push(args: argparse.Namespace) -> int:
    # grafana-client: the optional `ops` extra
    from grafana_client.client import GrafanaException

    from deployments.ops import grafana_push

    token = os.environ.get(args.token_env) or None
    api = grafana_push.connect(args.grafana_url, token, timeout=args.timeout)
    try:
        result = grafana_push.push(
            api,
            _load(args.dashboard),
            prometheus_url=None if args.no_datasource else args.prometheus_url,
            folder_uid=args.folder_uid,
        )
    except GrafanaException as exc:
        print(f"error: Grafana refused the upload: {exc}", file=sys.stderr)
        return 1
    if result.datasource_uid:
        verb = "created" if result.datasource_created else "updated"
        print(f"datasource {result.datasource_uid} {verb}")
    print(f"dashboard {result.dashboard_uid} saved: {result.dashboard_url}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    from deployments.ops import dashboard  # grafana-foundation-sdk: the optional `ops` extra

    parser = subparsers.add_parser("dashboards", help="build or upload the Grafana dashboard")
    commands = parser.add_subparsers(dest="dashboards_command", required=True)

    build = commands.add_parser("build", help="write the dashboard JSON (committed under k8s/)")
    build.add_argument(
        "--out", default=str(dashboard.REPO_ROOT / dashboard.DASHBOARD_PATH), help="output file"
    )
    build.set_defaults(func=_build)

    push = commands.add_parser(
        "push", help="upload the dashboard (and a Prometheus datasource) to Grafana"
    )
    push.add_argument("--grafana-url", required=True, help="e.g. http://grafana.monitoring:3000")
    push.add_argument(
        "--token-env",
        default=TOKEN_ENV,
        help=f"environment variable holding a service-account token (default {TOKEN_ENV}); "
        "without one, user:password in the URL is used",
    )
    push.add_argument(
        "--prometheus-url",
        default=DEFAULT_PROMETHEUS,
        help="URL Grafana reaches Prometheus at, for the 'MoLoRA Prometheus' datasource "
        f"(default {DEFAULT_PROMETHEUS})",
    )
    push.add_argument(
        "--no-datasource",
        action="store_true",
        help="upload only the dashboard; pick an existing Prometheus datasource in Grafana",
    )
    push.add_argument("--folder-uid", help="Grafana folder to save the dashboard in")
    push.add_argument("--dashboard", help="JSON file to upload (default: build it now)")
    push.add_argument("--timeout", type=float, default=10.0, help="HTTP timeout, seconds")
    push.set_defaults(func=_push)
