"""A few built things kept per owner (a model), the least recently used dropped first, shared across threads.

A server's requests may ask for any head size, head folder or draft depth: each built one was kept for the life of the
process, and a request's lookup raced another's eviction. Building runs outside the lock (it may take seconds);
two requests building the same thing at once keep one copy."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

T = TypeVar("T")


class Kept:
    """Per owner, at most ``keep`` things by key."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._owners: weakref.WeakKeyDictionary[Any, dict[Hashable, Any]] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def get(self, owner: Any, key: Hashable, build: Callable[[], T]) -> T:
        """The thing ``owner`` keeps under ``key``, built by ``build`` when it has none."""
        with self._lock:
            things = self._owners.setdefault(owner, {})
            if key in things:
                things[key] = thing = things.pop(key)  # the most recently used last
                return thing
        thing = build()
        with self._lock:
            things = self._owners.setdefault(owner, {})
            if key in things:  # (another request built it meanwhile)
                return things[key]
            while len(things) >= self.keep:  # (a request in flight keeps its own)
                things.pop(next(iter(things)))
            things[key] = thing
        return thing

    def held(self, owner: Any) -> int:
        """How many things ``owner`` keeps now."""
        with self._lock:
            return len(self._owners.get(owner, {}))
