"""`make serve` and `molora serve` start their own local Ray cluster on 127.0.0.1 unless given an
address: a run killed mid-way leaves Ray's current-cluster address file behind, and a bare
`serve run` connected to that dead GCS, retrying forever (issue 55)."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from deployments.ops import serve_cli
from deployments.replica import serve_env
from deployments.replica.serve_env import (
    LOOPBACK,
    command_address,
    ray_address_env,
    ray_address_file,
)
from tests.support import ports

ROOT = Path(__file__).resolve().parents[3]
NEW = f"starting a new local Ray cluster on {LOOPBACK}"


@pytest.fixture
def stale_ray_tmp(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, str]]:
    """A Ray temp dir (RAY_TMPDIR) whose address file names a GCS that is gone (a free port),
    as a killed cluster leaves it; RAY_ADDRESS unset. A short path: Ray's sockets go there."""
    base = Path(tempfile.mkdtemp(prefix="mr-"))
    dead = f"{LOOPBACK}:{ports.free_port()}"
    (base / "ray").mkdir()
    (base / "ray" / "ray_current_cluster").write_text(dead)
    monkeypatch.setenv("RAY_TMPDIR", str(base))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    yield base, dead
    shutil.rmtree(base, ignore_errors=True)


def test_the_address_file_is_where_ray_reads_it(stale_ray_tmp, monkeypatch) -> None:
    from ray._common.utils import get_ray_address_file

    assert ray_address_file(os.environ) == Path(get_ray_address_file(None))
    monkeypatch.delenv("RAY_TMPDIR")
    monkeypatch.setenv("TMPDIR", str(stale_ray_tmp[0]))
    assert ray_address_file(os.environ) == Path(get_ray_address_file(None))


def test_a_stale_address_file_makes_ray_dial_it_unless_told_local(
    stale_ray_tmp, monkeypatch
) -> None:
    """Ray's own choice, as `serve run` makes it (`ray.init(address=RAY_ADDRESS or None)`): the
    dead address from the file, the fault; with the launcher's environment, a new cluster."""
    from ray._private import services

    base, dead = stale_ray_tmp
    assert services.canonicalize_bootstrap_address(None).endswith(dead.rpartition(":")[2])
    env, line = ray_address_env(os.environ)
    assert env["RAY_ADDRESS"] == "local" and env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    assert line.startswith(NEW) and str(base) in line
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert services.canonicalize_bootstrap_address(None) is None  # None: start a new one


def test_an_address_given_is_used_and_said(stale_ray_tmp) -> None:
    assert ray_address_env({"RAY_ADDRESS": "10.0.0.5:6379"}) == (
        {},
        "connecting to RAY_ADDRESS=10.0.0.5:6379",
    )
    env, line = ray_address_env({"RAY_ADDRESS": "10.0.0.5:6379"}, "10.0.0.6:6379")
    assert (
        env == {"RAY_ADDRESS": "10.0.0.6:6379"} and line == "connecting to --address=10.0.0.6:6379"
    )
    # No address anywhere, no file: a new local cluster, nothing else said.
    env, line = ray_address_env({"RAY_TMPDIR": str(stale_ray_tmp[0] / "none"), "RAY_ADDRESS": ""})
    assert env["RAY_ADDRESS"] == "local" and line == NEW
    assert command_address(["serve", "run", "-a", "h:1", "c.yaml"]) == "h:1"
    assert command_address(["serve", "run", "--address=h:2", "c.yaml"]) == "h:2"
    assert command_address(["serve", "run", "c.yaml"]) is None


def test_make_serve_launcher_starts_its_own_cluster(stale_ray_tmp, monkeypatch, capsys) -> None:
    """`python -m deployments.replica.serve_env serve run CONFIG`, as `make serve` runs it."""
    calls: list[tuple[str, list[str], dict[str, str]]] = []
    monkeypatch.setattr(serve_env.os, "execvpe", lambda *a: calls.append(a))
    serve_env.main(["serve", "run", "serve_config.yaml"])
    (_, argv, env), err = calls.pop(), capsys.readouterr().err
    assert argv == ["serve", "run", "serve_config.yaml"] and env["RAY_ADDRESS"] == "local"
    assert f"serve_env: {NEW}" in err
    serve_env.main(["--address", "10.0.0.5:6379", "serve", "run", "serve_config.yaml"])
    assert calls.pop()[2]["RAY_ADDRESS"] == "10.0.0.5:6379"
    assert "connecting to --address=10.0.0.5:6379" in capsys.readouterr().err
    serve_env.main(["serve", "run", "--address", "10.0.0.7:6379", "serve_config.yaml"])
    assert "RAY_ADDRESS" not in calls.pop()[2]  # the command's own flag decides
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.8:6379")
    serve_env.main(["serve", "run", "serve_config.yaml"])
    assert calls.pop()[2]["RAY_ADDRESS"] == "10.0.0.8:6379"
    assert "connecting to RAY_ADDRESS=10.0.0.8:6379" in capsys.readouterr().err


def test_molora_serve_starts_its_own_cluster(stale_ray_tmp) -> None:
    def args(*argv: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        serve_cli.register(parser.add_subparsers())
        return parser.parse_args(["serve", "smollm2-135m-instruct", *argv])

    env, line = serve_cli.serve_run_env(args())
    assert env["RAY_ADDRESS"] == "local" and line.startswith(NEW)
    assert env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    assert env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] == "8000"
    env, line = serve_cli.serve_run_env(args("--address", "10.0.0.5:6379"))
    assert env["RAY_ADDRESS"] == "10.0.0.5:6379" and line == "connecting to --address=10.0.0.5:6379"
    env, line = serve_cli.serve_run_env(args(), {**os.environ, "RAY_ADDRESS": "10.0.0.8:6379"})
    assert (
        env["RAY_ADDRESS"] == "10.0.0.8:6379" and line == "connecting to RAY_ADDRESS=10.0.0.8:6379"
    )


# `serve run`'s own start, bounded: Ray connects the way `serve run` calls it, with the address
# its `--address` option defaults to (RAY_ADDRESS), in the environment the launcher hands over.
SERVE_RUN_INIT = """
import os, ray
ctx = ray.init(address=os.environ.get("RAY_ADDRESS"), namespace="serve", include_dashboard=False,
               log_to_driver=False)
print("GCS", ctx.address_info["gcs_address"], flush=True)
ray.shutdown()
"""


@pytest.mark.slow  # starts a Ray cluster of its own
def test_serve_run_start_does_not_hang_on_a_stale_address_file(stale_ray_tmp) -> None:
    _, dead = stale_ray_tmp
    launcher = [sys.executable, "-m", "deployments.replica.serve_env"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "token"}
    env["RAY_memory_monitor_refresh_ms"] = "0"  # a shared box's memory is not this cluster's
    proc = subprocess.Popen(
        [*launcher, sys.executable, "-c", SERVE_RUN_INIT],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"Ray's start hung (the stale {dead}?):\n{err[-3000:]}")
    assert proc.returncode == 0, err[-3000:]
    assert f"serve_env: {NEW}" in err
    gcs = re.search(r"^GCS (\S+)$", out, re.M)
    assert gcs is not None, out
    assert gcs[1].rpartition(":")[0] == LOOPBACK and gcs[1] != dead
