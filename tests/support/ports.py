"""Loopback ports for the servers that tests, benchmarks and local trials start (standard library only).

The one place a port number is chosen for a server we start ourselves. The usual trick (bind port
0, close, hand the number to the server) picks a port in the kernel's ephemeral range, which any
outgoing connection on the machine may take before the server binds it: that race broke fresh-clone
test runs (Ray's metrics exporter died with "Address already in use"). Ports here are drawn at
random from *below* the ephemeral range (so parallel sessions on one machine rarely pick the same
one), checked bindable first, and a server start that still loses its port is retried whole on
fresh ports (`retry_on_address_in_use`). Where a server can pick its own port and report it back
(Ray's metrics exporter), prefer that and read the port back.

Imports nothing of the project, so every layer (adapter_store, deployments, tests, benchmarks)
can use it.
"""

from __future__ import annotations

import errno
import secrets
import socket
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

LOW = 10000  # below: well-known and registered service ports (8000, 8080, 9090, 6379, ...)
# Ports other tools on this kind of machine use by default (Ray client server, Ray's dashboard
# agent, Prometheus' node exporter...). Never handed out.
RESERVED = frozenset({10001, 52365, 52366, 6379, 8265, 9100})
ADDRESS_IN_USE = ("address already in use", "eaddrinuse", "errno 98", "port is already in use")


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux; else IANA's default)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[:2]
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def candidate_range(span: int = 0) -> tuple[int, int]:
    """[low, high) that ports (and port + span) are drawn from: below the ephemeral range, or
    above it where the ephemeral range starts too low to leave room."""
    eph_low, eph_high = ephemeral_range()
    if eph_low - span - LOW >= 1000:
        return LOW, eph_low - span
    if 65535 - span - eph_high > 1000:
        return eph_high + 1, 65536 - span
    return LOW, 65536 - span  # no room outside it: still random and checked, and retried


def bindable(port: int, host: str = "127.0.0.1") -> bool:
    """Nobody listens on (or holds) host:port, nor on the wildcard address at that port."""
    for address in dict.fromkeys((host, "0.0.0.0")):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((address, port))
            except OSError:
                return False
    return True


def free_ports(
    n: int, *, offsets: Iterable[int] = (0,), host: str = "127.0.0.1", exclude: Iterable[int] = ()
) -> list[int]:
    """n distinct random ports p outside the ephemeral range with every p + offset bindable
    (SeaweedFS derives gRPC ports as p + 10000: offsets=(0, 10000))."""
    offsets = tuple(offsets)
    span = max(offsets)
    low, high = candidate_range(span)
    rng = secrets.SystemRandom()
    taken = set(exclude)
    chosen: list[int] = []
    for _ in range(100_000):
        if len(chosen) == n:
            return chosen
        port = rng.randrange(low, high)
        wanted = {port + o for o in offsets}
        if wanted & (taken | RESERVED):
            continue
        if all(bindable(p, host) for p in wanted):
            chosen.append(port)
            taken |= wanted
    raise RuntimeError(f"found only {len(chosen)} of {n} free ports in [{low}, {high})")


def free_port(host: str = "127.0.0.1", exclude: Iterable[int] = ()) -> int:
    """One random bindable port outside the ephemeral range."""
    return free_ports(1, host=host, exclude=exclude)[0]


def is_address_in_use(error: BaseException | str | None) -> bool:
    """Whether an exception (or its chain) or a log text says a port was already taken."""
    seen: set[int] = set()
    while isinstance(error, BaseException) and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno == errno.EADDRINUSE:
            return True
        if is_address_in_use(str(error)):
            return True
        error = error.__cause__ or error.__context__
    return isinstance(error, str) and any(m in error.lower() for m in ADDRESS_IN_USE)


def retry_on_address_in_use(
    start: Callable[[], T],
    *,
    attempts: int = 3,
    lost_port: Callable[[BaseException], bool] = is_address_in_use,
    cleanup: Callable[[], object] | None = None,
) -> T:
    """Run `start` (which picks its ports afresh each call) until it does not fail on a taken
    port; any other failure, or the last attempt's, is raised."""
    for attempt in range(attempts):
        try:
            return start()
        except Exception as exc:
            if attempt == attempts - 1 or not lost_port(exc):
                raise
            if cleanup is not None:
                cleanup()
    raise AssertionError("unreachable")
