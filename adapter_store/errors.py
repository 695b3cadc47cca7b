"""Store errors: one class per failure a caller (or a script, via exit codes) may act on."""

from __future__ import annotations

import errno


class StoreError(Exception):
    """Base of every adapter-store failure; `exit_code` is what the CLI returns for it."""

    exit_code = 1


class InvalidInputError(StoreError, ValueError):
    """A name, version, URL, folder or file was rejected before anything was written."""

    exit_code = 3


class NotFoundError(StoreError, LookupError):
    """The adapter, composition or version does not exist (or is not cached while offline)."""

    exit_code = 4


class VersionExistsError(StoreError):
    """Versions are immutable: this name@version was already published."""

    exit_code = 5


class IntegrityError(StoreError):
    """A downloaded or stored object does not match the sha256/size in its manifest."""

    exit_code = 6


class StoreUnavailableError(StoreError, ConnectionError):
    """The store cannot be reached (network down, server stopped, endpoint wrong)."""

    exit_code = 7


class StoreAccessError(StoreError, PermissionError):
    """The store answered but refused the request (credentials, permissions, missing bucket)."""

    exit_code = 8


class DiskFullError(StoreError, OSError):
    """The local disk (store cache or local store) ran out of space; nothing partial was kept."""

    exit_code = 9


def disk_full(exc: OSError, what: str) -> DiskFullError | None:
    """A clear DiskFullError for ENOSPC/EDQUOT (None for any other OSError)."""
    if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
        return None
    return DiskFullError(f"{what}: no space left on the disk ({exc.strerror}); free space there")


class RuleError(ValueError):
    """An adapter or composition breaks a rule; the message names the tensor or key at fault."""
