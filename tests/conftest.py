"""Shared test settings: loopback-only Ray with token auth, deterministic seeds, shared servers
started once (tests/start_once.py)."""

from __future__ import annotations

import os
import secrets

import pytest
import torch

from tests.start_once import STARTS, setup_starts

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Ray token auth stays on: without it a Serve replica's gRPC server (every interface, unpickles
# requests) takes unauthenticated calls. Each test session uses its own random token, passed to
# Ray's processes in the environment, rather than racing other sessions on this machine to create
# the shared ~/.ray/auth_token file. Set before Ray is imported: Ray caches its auth config.
os.environ["RAY_AUTH_MODE"] = "token"
if not (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")):
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton runs on CPU only through its interpreter, which it reads when `triton` itself is first
# imported (its library's own jit functions are decorated then), and many test modules import it
# through transformers and peft: set it before any of them is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    setup_starts(item)


# ----- the `slow` marker, assigned by what a test starts -------------------------------------
# `make test-quick` runs `-m "not slow and not gpu"`; a test is slow when it starts a server or
# loads the real checkpoint. Deciding that from fixtures, not from hand-kept lists of files,
# keeps a new test that takes `client` or `seaweed` out of the quick loop without anyone
# remembering to mark it. Modules that start a server without a shared fixture (a `serve run`
# subprocess, a SeaweedFS the test kills) carry `pytestmark = pytest.mark.slow` themselves.

# Fixtures whose setup starts a server or loads SmolLM2-135M's weights, by name. The shared
# servers of tests/start_once.py (the Ray/Serve cluster, the multi-node one with SeaweedFS and
# Redis, the Prometheus end-to-end app) are added from its registry.
SLOW_FIXTURES = frozenset(
    {
        "seaweed",  # SeaweedFS S3 (tests/adapter_store/conftest.py, test_peft_folder_serving.py)
        "smollm2",  # the real SmolLM2-135M, loaded twice (tests/molora_runtime/conftest.py)
    }
)
# Parametrized fixtures whose listed values start a server through `request.getfixturevalue`,
# which leaves no trace in `item.fixturenames`: the `local` twin of each test stays quick.
SLOW_PARAMS = {"store_url": "s3"}


def _starts_something(item: pytest.Item) -> bool:
    names = set(getattr(item, "fixturenames", ()))
    if not names.isdisjoint(SLOW_FIXTURES.union(STARTS)):
        return True
    params = getattr(getattr(item, "callspec", None), "params", {})
    return any(params.get(name) == value for name, value in SLOW_PARAMS.items())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark `slow` every test that starts a server or loads the real model (see SLOW_FIXTURES).

    Runs after every module is imported, so each `StartOnce` fixture is in STARTS by now."""
    for item in items:
        if _starts_something(item):
            item.add_marker(pytest.mark.slow)
