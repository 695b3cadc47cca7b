"""The front benchmark's bookkeeping: pair order, process roles, CPU per token, its configs."""

from __future__ import annotations

import stat
from pathlib import Path

import yaml

from benchmarks.serve_front import (
    cpu_ms_per_token,
    front_config,
    front_env,
    pair_order,
    role,
    summarize,
)


def _row(front: str, pair: int, conc: int, tok_s: float, server: dict[str, float]) -> dict:
    return {
        "front": front,
        "pair": pair,
        "concurrency": conc,
        "tok_per_s": tok_s,
        "completion_tokens": 2048,
        "ttft_p50_ms": 400.0,
        "itl_p99_ms": 350.0,
        "cpu_s": {"client": 0.5, "server": server},
    }


def test_pairs_reverse_their_order_so_drift_favours_no_front() -> None:
    assert pair_order(0) == ["proxy", "haproxy"]
    assert pair_order(1) == ["haproxy", "proxy"]
    assert pair_order(2) == ["proxy", "haproxy"]


def test_processes_are_named_by_their_serving_role() -> None:
    assert role("ray::ServeReplica:molora:ModelReplica 16196") == "replica"
    assert role("ray::ServeReplica:molora:Router 16277") == "router"
    assert role("ray::ProxyActor 16108") == "proxy"
    assert role("haproxy 17314") == "haproxy"
    assert role("ray::HAProxyManager 17115") == "haproxy_manager"
    assert role("ray::ServeController.listen_for_change 16107") == "controller"
    assert role("gcs_server 15729") == "other"


def test_cpu_per_token_sums_each_role() -> None:
    row = _row("proxy", 0, 8, 70.0, {
        "ray::ServeReplica:molora:Router 1": 2.048,
        "ray::ProxyActor 2": 1.024,
        "gcs_server 3": 0.2048,
        "raylet 4": 0.2048,
    })  # fmt: skip
    assert cpu_ms_per_token(row) == {"other": 0.2, "proxy": 0.5, "router": 1.0}


def test_haproxy_state_lives_in_a_private_folder(tmp_path: Path) -> None:
    state = tmp_path / "state"
    env = front_env("haproxy", state)
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"  # HAProxy routes to the direct ports
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    for key in ("RAY_SERVE_HAPROXY_SOCKET_PATH", "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC"):
        assert Path(env[key]).parent == state
    assert front_env("proxy", tmp_path / "unused")["RAY_SERVE_ENABLE_HA_PROXY"] == "0"
    assert not (tmp_path / "unused").exists()


def test_the_front_reaches_the_replicas_environment(tmp_path: Path) -> None:
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({"applications": [{
        "name": "molora",
        "runtime_env": {"env_vars": {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "0", "KEEP": "1"}},
    }]}))  # fmt: skip
    env = front_env("haproxy", tmp_path / "state")
    out = yaml.safe_load(front_config(base, env, tmp_path / "out.yaml").read_text())
    env_vars = out["applications"][0]["runtime_env"]["env_vars"]
    assert env_vars["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    assert env_vars["KEEP"] == "1"


def test_the_table_pairs_fronts_round_by_round() -> None:
    rows = [
        _row("proxy", 0, 8, 70.0, {"ray::ProxyActor 1": 2.048}),
        _row("haproxy", 0, 8, 77.0, {"haproxy 2": 0.2048}),
        _row("haproxy", 1, 8, 66.0, {"haproxy 2": 0.2048}),
        _row("proxy", 1, 8, 60.0, {"ray::ProxyActor 1": 2.048}),
    ]
    table = summarize(rows)
    proxy = next(line for line in table if "| proxy |" in line)
    haproxy = next(line for line in table if "| haproxy |" in line)
    assert "70.0 / 60.0 | 65.0 |" in proxy
    assert "77.0 / 66.0 | 71.5 | 1.1 / 1.1 |" in haproxy
    assert proxy.endswith("| 1.00 |") and haproxy.endswith("| 0.10 |")
