"""Ports for the servers tests start: one helper, outside the ephemeral range, retried when lost;
a shared start that fails is one error; and nothing turns Ray's token auth off."""

from __future__ import annotations

import errno
import re
import socket
from pathlib import Path

import pytest

from tests.start_once import StartOnce
from tests.support import ports

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("adapter_store", "benchmarks", "deployments", "k8s", "kernels", "molora_runtime")
SOURCES += ("scripts", "tests")
TOP_FILES = ("Makefile", "README.md", "serve_config.yaml", "serve_config.gpu.yaml", ".ci/run")


def _project_files() -> list[Path]:
    files = [ROOT / name for name in TOP_FILES if (ROOT / name).is_file()]
    for folder in SOURCES:
        files += [
            p
            for p in (ROOT / folder).rglob("*")
            if p.is_file() and p.suffix in (".py", ".sh", ".yaml", ".yml", ".md", ".json", "")
        ]
    return [p for p in files if "__pycache__" not in p.parts]


def test_ports_are_outside_the_ephemeral_range_and_bindable() -> None:
    eph_low, eph_high = ports.ephemeral_range()
    chosen = ports.free_ports(20)
    assert len(set(chosen)) == 20
    for port in chosen:
        assert not eph_low <= port <= eph_high, port
        assert port not in ports.RESERVED
        assert ports.bindable(port)


def test_offset_ports_are_free_too() -> None:
    for port in ports.free_ports(5, offsets=(0, 10000)):
        assert ports.bindable(port + 10000)
        assert port + 10000 < ports.ephemeral_range()[0] or port > ports.ephemeral_range()[1]


def test_a_listening_port_is_not_bindable() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", ports.free_port()))
        held.listen()
        port = held.getsockname()[1]
        assert not ports.bindable(port)
        assert port not in ports.free_ports(50, exclude=())  # checked, never handed out


def test_address_in_use_is_recognised() -> None:
    assert ports.is_address_in_use(OSError(errno.EADDRINUSE, "Address already in use"))
    wrapped = RuntimeError("start failed")
    wrapped.__cause__ = OSError(errno.EADDRINUSE, "x")
    assert ports.is_address_in_use(wrapped)
    assert ports.is_address_in_use("listen tcp 127.0.0.1:9090: bind: address already in use")
    assert not ports.is_address_in_use(RuntimeError("connection refused"))


def test_a_start_that_loses_its_port_is_retried_whole() -> None:
    calls: list[int] = []
    cleaned: list[int] = []

    def start() -> int:
        calls.append(ports.free_port())
        if len(calls) < 3:
            raise OSError(errno.EADDRINUSE, "Address already in use")
        return calls[-1]

    assert ports.retry_on_address_in_use(start, cleanup=lambda: cleaned.append(1)) == calls[-1]
    assert len(calls) == 3 and len(cleaned) == 2


def test_other_start_failures_are_not_retried() -> None:
    calls: list[int] = []

    def start() -> None:
        calls.append(1)
        raise RuntimeError("bad config")

    with pytest.raises(RuntimeError, match="bad config"):
        ports.retry_on_address_in_use(start)
    assert calls == [1]


def test_a_failed_shared_start_is_one_error_then_skips() -> None:
    started: list[int] = []

    def start() -> None:
        started.append(1)
        raise RuntimeError("raylet died: log tail here")

    once = StartOnce("_probe", start, lambda _: None)
    with pytest.raises(pytest.fail.Exception, match="log tail here"):
        once.ensure("tests/a.py::test_first")
    with pytest.raises(pytest.skip.Exception, match=r"reported at tests/a.py::test_first"):
        once.ensure("tests/a.py::test_second")
    assert started == [1]  # not retried by every later test


# Patterns of choosing a port any other way than tests/support/ports.py (bind port 0 and hand the
# number on; a fixed metrics port), and of turning Ray's token auth off.
OTHER_PORT_PICKING = re.compile(r"\.bind\(\(|getsockname\(|_metrics_export_port\s*=")
AUTH_OFF = re.compile(r"RAY_AUTH_MODE\W{0,6}disabled", re.IGNORECASE)
# Binds a given port only to see whether it is free yet (the router's fixed port); picks none.
PORT_PROBES = {"tests/support/ports.py", "deployments/replica/serve_env.py"}


def test_no_port_is_picked_any_other_way_and_auth_stays_on() -> None:
    this = Path(__file__).resolve()
    offenders = []
    for path in _project_files():
        if path.resolve() == this:
            continue
        text = path.read_text(errors="replace")
        rel = path.relative_to(ROOT)
        if str(rel) not in PORT_PROBES and OTHER_PORT_PICKING.search(text):
            offenders.append(f"{rel}: picks a port itself (use tests.support.ports)")
        if AUTH_OFF.search(text):
            offenders.append(f"{rel}: turns Ray token auth off")
    assert not offenders, offenders
