"""The tokens a step carries: a view onto a generation's sequence and a block, never a copy of either."""

from __future__ import annotations

from collections.abc import Sequence
from typing import overload


class Context(Sequence[int]):
    """The tokens a step needs fed: the first `base_len` of a generation's sequence, which only ever
    grows (so that prefix never changes), then `extra` (a block under verification). A step reads only
    what it appends; nothing copies the sequence."""

    __slots__ = ("base", "base_len", "extra")

    def __init__(self, base: list[int], extra: Sequence[int] = (), base_len: int | None = None) -> None:
        self.base = base
        self.base_len = len(base) if base_len is None else base_len
        self.extra = list(extra)

    def __len__(self) -> int:
        return self.base_len + len(self.extra)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            start, stop, stride = index.indices(len(self))
            if stride != 1:
                raise ValueError("a context is sliced with a step of 1")
            head = self.base[start : min(stop, self.base_len)] if start < self.base_len else []
            return head + self.extra[max(start - self.base_len, 0) : max(stop - self.base_len, 0)]
        if index < 0:
            index += len(self)
        return self.base[index] if index < self.base_len else self.extra[index - self.base_len]
