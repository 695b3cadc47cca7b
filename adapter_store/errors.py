"""Store errors: one class per failure a caller (or a script, via exit codes) may act on."""

from __future__ import annotations

import errno
from typing import Any, ClassVar


class StoreError(Exception):
    """Base of every adapter-store failure; `exit_code` is what the CLI returns for it.

    Each failure names its code in its header (`class X(StoreError, exit_code=3)`); a code
    already taken is refused at import, so a script can always tell two failures apart. A
    subclass without one (such as the wrapper Ray derives for a remote error) keeps its base's.
    """

    exit_code: ClassVar[int] = 1
    _taken: ClassVar[dict[int, str]] = {1: "StoreError"}

    def __init_subclass__(cls, exit_code: int | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if exit_code is None:
            return
        if exit_code in StoreError._taken:
            raise TypeError(
                f"{cls.__name__}: exit code {exit_code} is {StoreError._taken[exit_code]}'s"
            )
        StoreError._taken[exit_code] = cls.__name__
        cls.exit_code = exit_code


class InvalidInputError(StoreError, ValueError, exit_code=3):
    """A name, version, URL, folder or file was rejected before anything was written."""


class NotFoundError(StoreError, LookupError, exit_code=4):
    """The adapter, composition or version does not exist (or is not cached while offline)."""


class VersionExistsError(StoreError, exit_code=5):
    """Versions are immutable: this name@version was already published."""


class IntegrityError(StoreError, exit_code=6):
    """A downloaded or stored object does not match the sha256/size in its manifest."""


class StoreUnavailableError(StoreError, ConnectionError, exit_code=7):
    """The store cannot be reached (network down, server stopped, endpoint wrong)."""


class StoreAccessError(StoreError, PermissionError, exit_code=8):
    """The store answered but refused the request (credentials, permissions, missing bucket)."""


class DiskFullError(StoreError, OSError, exit_code=9):
    """The local disk (store cache or local store) ran out of space; nothing partial was kept."""


class ReadOnlyStoreError(StoreError, PermissionError, exit_code=10):
    """A write (push, yank, delete, runtime load) reached a store that is read-only by design."""


def disk_full(exc: OSError, what: str) -> DiskFullError | None:
    """A clear DiskFullError for ENOSPC/EDQUOT (None for any other OSError)."""
    if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
        return None
    return DiskFullError(f"{what}: no space left on the disk ({exc.strerror}); free space there")


class RuleError(ValueError):
    """An adapter or composition breaks a rule; the message names the tensor or key at fault."""
