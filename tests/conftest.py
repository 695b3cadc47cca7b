"""Shared test settings: loopback-only Ray with token auth, deterministic seeds, shared servers
started once (tests/start_once.py)."""

from __future__ import annotations

import os
import secrets

import pytest
from start_once import setup_starts

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Ray token auth stays on: without it a Serve replica's gRPC server (every interface, unpickles
# requests) takes unauthenticated calls. Each test session uses its own random token, passed to
# Ray's processes in the environment, rather than racing other sessions on this machine to create
# the shared ~/.ray/auth_token file. Set before Ray is imported: Ray caches its auth config.
os.environ["RAY_AUTH_MODE"] = "token"
if not (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")):
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    setup_starts(item)
