"""Names, versions and refs: anything that could escape a key prefix is refused up front."""

from __future__ import annotations

from pathlib import Path

import pytest

from adapter_store import InvalidInputError, Registry, parse_ref
from adapter_store.names import check_name, check_version

BAD_NAMES = ["../x", "..", ".", "", "Upper", "a/b", "/abs", "-lead", "_lead", "a b", "x" * 65, "é"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_names_refused(name: str) -> None:
    with pytest.raises(InvalidInputError, match="invalid name"):
        check_name(name)


@pytest.mark.parametrize("version", ["", "../1", "-1", "1/2", "v" * 65, "1 2"])
def test_bad_versions_refused(version: str) -> None:
    with pytest.raises(InvalidInputError, match="invalid version"):
        check_version(version)


def test_refs_parse() -> None:
    assert parse_ref("math-lora") == ("math-lora", None)
    assert parse_ref("math.v2_x@2024-01-01.RC1") == ("math.v2_x", "2024-01-01.RC1")
    assert str(parse_ref("a@1")) == "a@1"
    for bad in ["", "a@", "@1", "A@1", "a@1@2", "../x@1"]:
        with pytest.raises(InvalidInputError):
            parse_ref(bad)


@pytest.mark.parametrize("name", ["../x", "UPPER", ""])
def test_push_with_bad_name_leaves_store_empty(registry: Registry, alpha: Path, name: str) -> None:
    with pytest.raises(InvalidInputError, match="invalid name"):
        registry.publish_adapter(alpha, name, "1")
    assert registry.names("adapter") == []
    assert registry.backend.list_keys("") == []
