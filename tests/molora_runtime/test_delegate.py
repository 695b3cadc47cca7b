"""`Delegate`: one-line attributes that read (and, when writable, write) a member's attribute."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from molora_runtime.delegate import Delegate


@dataclass
class Inner:
    value: int
    other: str = "x"


@dataclass
class Outer:
    inner: Inner
    value = Delegate[int]("inner.value", writable=True)
    other = Delegate[str]("inner.other")


def test_reads_follow_the_member_and_writes_reach_it() -> None:
    outer = Outer(Inner(1))
    assert outer.value == 1
    outer.inner.value = 2
    assert outer.value == 2
    outer.value = 3
    assert outer.inner.value == 3


def test_a_read_only_delegate_refuses_assignment_and_is_not_a_dataclass_field() -> None:
    outer = Outer(Inner(1))
    with pytest.raises(AttributeError, match="read-only"):
        outer.other = "y"
    assert outer.inner.other == "x"
    assert [f for f in Outer.__dataclass_fields__] == ["inner"]
    assert isinstance(Outer.value, Delegate)


def test_a_path_without_a_member_is_refused() -> None:
    with pytest.raises(ValueError, match="names a member"):
        Delegate[int]("value")
