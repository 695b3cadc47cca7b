"""Names, versions and references (`name` or `name@version`): the only strings that become keys.

Validating them here is what keeps a store key from ever escaping its prefix (`../x`, `/abs`).
"""

from __future__ import annotations

import re
from typing import Literal, NamedTuple

from adapter_store.errors import InvalidInputError

NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
VERSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

Kind = Literal["adapter", "composition"]
KINDS: tuple[Kind, ...] = ("adapter", "composition")


class Ref(NamedTuple):
    """A parsed reference; `version is None` means "latest"."""

    name: str
    version: str | None

    def __str__(self) -> str:
        return self.name if self.version is None else f"{self.name}@{self.version}"


def _check_label(what: str, value: str) -> str:
    if not isinstance(value, str) or not NAME_RE.fullmatch(value) or value in {".", ".."}:
        raise InvalidInputError(
            f"invalid {what} {value!r}: use 1-64 characters, lowercase letters, digits, '.', '_' "
            "or '-', starting with a letter or digit"
        )
    return value


def check_name(name: str) -> str:
    return _check_label("name", name)


def check_tenant(tenant: str) -> str:
    """Tenant names follow the name rules, so they are safe in logs, labels and paths."""
    return _check_label("tenant", tenant)


def check_version(version: str) -> str:
    if not isinstance(version, str) or not VERSION_RE.fullmatch(version):
        raise InvalidInputError(
            f"invalid version {version!r}: use 1-64 characters, letters, digits, '.', '_' or "
            "'-', starting with a letter or digit"
        )
    return version


def parse_ref(ref: str) -> Ref:
    """Split and validate `name` or `name@version`."""
    if not isinstance(ref, str) or not ref:
        raise InvalidInputError("empty reference: expected 'name' or 'name@version'")
    name, sep, version = ref.partition("@")
    check_name(name)
    if not sep:
        return Ref(name, None)
    return Ref(name, check_version(version))
