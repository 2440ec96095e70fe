"""Typed per-run storage for plugins: ``run.stash[KEY]``, in the shape of pytest's ``Stash``.

The plugin that owns a value defines its :class:`StashKey` next to the code that sets it;
other plugins import that key object. Nothing crosses a plugin boundary by string.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar, cast, overload

__all__ = ["Stash", "StashKey"]

T = TypeVar("T")
D = TypeVar("D")


class StashKey(Generic[T]):
    """A key of :class:`Stash`; ``StashKey[int]("steps")`` types what it holds.

    Two keys with the same name are different keys: identity, not the name, is the key.
    The name only shows in ``repr`` and errors.
    """

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"StashKey({self.name!r})"


class Stash:
    """A mapping from :class:`StashKey` to values of the key's type."""

    __slots__ = ("_data",)

    def __init__(self) -> None:
        self._data: dict[StashKey[Any], Any] = {}

    def __setitem__(self, key: StashKey[T], value: T) -> None:
        self._data[key] = value

    def __getitem__(self, key: StashKey[T]) -> T:
        try:
            return cast(T, self._data[key])
        except KeyError:
            raise KeyError(f"{key!r} is not set on this run") from None

    @overload
    def get(self, key: StashKey[T]) -> T | None: ...

    @overload
    def get(self, key: StashKey[T], default: D) -> T | D: ...

    def get(self, key: StashKey[Any], default: Any = None) -> Any:
        return self._data.get(key, default)

    def setdefault(self, key: StashKey[T], default: T) -> T:
        return cast(T, self._data.setdefault(key, default))

    def pop(self, key: StashKey[T], default: Any = None) -> Any:
        return self._data.pop(key, default)

    def __delitem__(self, key: StashKey[Any]) -> None:
        del self._data[key]

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)
