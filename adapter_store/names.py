"""Names, versions and references (`name` or `name@version`): the only strings that become keys.

Validating them here is what keeps a store key from ever escaping its prefix (`../x`, `/abs`).
A tenant's own namespace is a store name `tenant~name` (`~` is in no plain name, so it never
collides with a public name or another tenant's); only that tenant may own it.
"""

from __future__ import annotations

import re
from typing import Literal, NamedTuple

from adapter_store.errors import InvalidInputError

NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
NAMESPACE_SEP = "~"
STORE_NAME_RE = re.compile(r"(?:[a-z0-9][a-z0-9._-]{0,63}~)?[a-z0-9][a-z0-9._-]{0,63}")
VERSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

Kind = Literal["adapter", "composition"]
KINDS: tuple[Kind, ...] = ("adapter", "composition")


class Ref(NamedTuple):
    """A parsed reference; `version is None` means "latest"."""

    name: str
    version: str | None

    def __str__(self) -> str:
        return self.name if self.version is None else f"{self.name}@{self.version}"


NAME_RULE = (
    "use 1-64 characters, lowercase letters, digits, '.', '_' or '-', starting with a letter or "
    "digit"
)
VERSION_RULE = (
    "use 1-64 characters, letters, digits, '.', '_' or '-', starting with a letter or digit"
)


def _matching(what: str, value: str, pattern: re.Pattern[str], rule: str) -> str:
    """`value` when it is a string `pattern` matches whole, else the error that states `rule`."""
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise InvalidInputError(f"invalid {what} {value!r}: {rule}")
    return value


def _check_label(what: str, value: str) -> str:
    if _matching(what, value, NAME_RE, NAME_RULE) in {".", ".."}:
        raise InvalidInputError(f"invalid {what} {value!r}: {NAME_RULE}")
    return value


def check_plain_name(name: str) -> str:
    """A name as a caller writes it (no namespace)."""
    return _check_label("name", name)


def check_name(name: str) -> str:
    """A store name: a plain name, or `tenant~name` in a tenant's namespace."""
    _matching("name", name, STORE_NAME_RE, f"{NAME_RULE} (optionally after 'tenant~')")
    namespace, _, plain = name.rpartition(NAMESPACE_SEP)
    if plain in {".", ".."} or namespace in {".", ".."}:
        raise InvalidInputError(f"invalid name {name!r}")
    return name


def namespaced(tenant: str, name: str) -> str:
    """The store name of `name` in `tenant`'s namespace."""
    return f"{check_tenant(tenant)}{NAMESPACE_SEP}{check_plain_name(name)}"


def namespace_of(name: str) -> str | None:
    """The tenant whose namespace holds store name `name` (None for a plain name)."""
    namespace, sep, _ = name.partition(NAMESPACE_SEP)
    return namespace if sep else None


def plain_name(name: str) -> str:
    """`name` without its namespace: what its owner calls it."""
    return name.rpartition(NAMESPACE_SEP)[2]


def check_owner(name: str, tenant: str | None) -> None:
    """A namespaced name belongs to its namespace's tenant and to no one else."""
    namespace = namespace_of(name)
    if namespace is not None and namespace != tenant:
        raise InvalidInputError(
            f"name {name!r} is in tenant {namespace!r}'s namespace; it must be published with "
            f"that tenant, not {tenant!r}"
        )


def check_tenant(tenant: str) -> str:
    """Tenant names follow the name rules, so they are safe in logs, labels and paths."""
    return _check_label("tenant", tenant)


def check_version(version: str) -> str:
    return _matching("version", version, VERSION_RE, VERSION_RULE)


def parse_ref(ref: str) -> Ref:
    """Split and validate `name` or `name@version`."""
    if not isinstance(ref, str) or not ref:
        raise InvalidInputError("empty reference: expected 'name' or 'name@version'")
    name, sep, version = ref.partition("@")
    check_name(name)
    if not sep:
        return Ref(name, None)
    return Ref(name, check_version(version))
