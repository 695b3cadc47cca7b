"""An attribute a class hands on to one of its members, declared in one line instead of a property.

`waiting = Delegate[deque[Sequence]]("scheduler.waiting")` reads `self.scheduler.waiting`;
with `writable=True` an assignment goes to the member too, otherwise it is refused as a
read-only property's would be.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any, Generic, TypeVar, overload

T = TypeVar("T")


class Delegate(Generic[T]):
    """A class attribute that reads (and, if `writable`, writes) the dotted `path` on the
    instance."""

    def __init__(self, path: str, writable: bool = False) -> None:
        owner, _, self.name = path.rpartition(".")
        if not owner:
            raise ValueError(f"{path!r}: a delegate names a member and its attribute")
        self.path = path
        self.writable = writable
        self._get = attrgetter(path)
        self._owner = attrgetter(owner)

    @overload
    def __get__(self, obj: None, cls: type | None = None) -> Delegate[T]: ...
    @overload
    def __get__(self, obj: object, cls: type | None = None) -> T: ...
    def __get__(self, obj: Any, cls: type | None = None) -> Any:
        return self if obj is None else self._get(obj)

    def __set__(self, obj: object, value: T) -> None:
        if not self.writable:
            raise AttributeError(f"{self.path} is read-only here")
        setattr(self._owner(obj), self.name, value)
