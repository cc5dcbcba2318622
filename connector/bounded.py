"""``BoundedDict``: an insertion-ordered dict that keeps at most ``limit`` entries.

Every memory kvpush keeps of things that may never be claimed (announcements that came before
their request, notices of forgotten transfers, seen nonces, aborts of requests not yet seen,
timing marks) is one of these: adding an entry past the limit drops the oldest.

Threading model: none; the owner locks (like a dict).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


class BoundedDict(OrderedDict[K, V]):
    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"BoundedDict limit must be >= 0, not {limit}")
        super().__init__()
        self.limit = limit

    def __setitem__(self, key: K, value: V) -> None:
        super().__setitem__(key, value)
        while len(self) > self.limit:
            self.popitem(last=False)

    def refresh(self, key: K, value: V) -> None:
        """Set ``key`` and make it the newest (least likely to be dropped next)."""
        self[key] = value
        self.move_to_end(key)
