"""A server many tests share, started once: a failed start is one loud error, not one per test.

A fixture that raises is re-raised by pytest for every test that uses it (35 identical errors
for one Ray start that lost a port). Instead the start runs in `pytest_runtest_setup` (see
tests/conftest.py) for the first test that needs the fixture: if it fails, that test errors
with the whole message (log tails included) and every later one is skipped with a pointer to it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

STARTS: dict[str, StartOnce] = {}


class StartOnce:
    """`start()` for the fixture `fixture`; failures of type `errors` are reported once."""

    def __init__(
        self,
        fixture: str,
        start: Callable[[], Any],
        stop: Callable[[Any], object],
        errors: tuple[type[BaseException], ...] = (Exception,),
    ) -> None:
        self.fixture, self._start, self._stop, self._errors = fixture, start, stop, errors
        self.value: Any = None
        self.failed_at: str | None = None
        STARTS[fixture] = self

    def ensure(self, nodeid: str) -> Any:
        if self.value is not None:
            return self.value
        if self.failed_at is not None:
            pytest.skip(f"{self.fixture} did not start; the error is reported at {self.failed_at}")
        try:
            self.value = self._start()
            return self.value
        except self._errors as exc:
            self.failed_at = nodeid
            message = f"{self.fixture} did not start:\n{exc}"
        pytest.fail(message, pytrace=False)  # outside `except`: the message once, no chain

    def stop(self) -> None:
        value, self.value = self.value, None
        if value is not None:
            self._stop(value)


def setup_starts(item: pytest.Item) -> None:
    """Start (once) what the item's fixtures need, before pytest sets those fixtures up."""
    for name in getattr(item, "fixturenames", ()):
        once = STARTS.get(name)
        if once is not None:
            once.ensure(item.nodeid)
