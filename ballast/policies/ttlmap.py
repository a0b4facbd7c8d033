"""The one bounded TTL map: entries kept ``ttl_s`` after they finish, at most ``max_entries``.

Used by every store that remembers answers for a while: the router's Idempotency-Key
store, the key table every router shares, the cache of answers to identical calls.

An entry is *pending* (its TTL has not started: an answer still being made) or
*finished* at a time, from which it lives ``ttl_s`` (the boundary included: it is gone
once its age exceeds ``ttl_s``). A pending entry lives until it finishes, is removed,
or its lease runs out (``lease_until_s``, the instant itself excluded).

Order is insertion order (``touch`` on a lookup makes an entry the newest, for a
least-recently-used cache). Inserting a new key into a full map drops the oldest entry
first (``keep_pending``: the oldest finished one, then the oldest pending one).
Expired entries are dropped when looked up, or all at once by ``expire``.

A plain data structure: time comes in as an argument (the caller reads its injected
clock); nothing here reads a clock, sleeps or locks. Not thread-safe: each map is owned
by one store on one thread or event loop.

Written by hand: ``collections.OrderedDict`` is the order, but no standard-library type
bounds entries by count and by an age that starts when the caller says, on its clock.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from collections.abc import Hashable
from typing import Generic, Optional, TypeVar

from ballast.policies.validation import check_int, check_positive

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass
class Held(Generic[V]):
    """One entry: its value, when its TTL started (None: pending), and its lease while pending."""

    value: V
    done_at_s: Optional[float] = None
    lease_until_s: float = math.inf

    @property
    def done(self) -> bool:
        return self.done_at_s is not None

    def finish(self, now_s: float) -> None:
        """Start the TTL: the entry now lives ``ttl_s`` from ``now_s``."""
        self.done_at_s = now_s

    def expired(self, now_s: float, ttl_s: float) -> bool:
        """Finished more than ``ttl_s`` ago, or pending past its lease."""
        if self.done_at_s is not None:
            return now_s - self.done_at_s > ttl_s
        return now_s >= self.lease_until_s


class TTLMap(Generic[K, V]):
    """Entries bounded in count (``max_entries``) and age (``ttl_s`` after they finish).

    Invariant: ``len(self) <= max_entries``; no lookup returns an expired entry.
    """

    def __init__(self, ttl_s: float, max_entries: int, keep_pending: bool = False) -> None:
        check_positive("ttl_s", ttl_s)
        check_int("max_entries", max_entries, minimum=1)
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._keep_pending = keep_pending
        self._entries: "OrderedDict[K, Held[V]]" = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def full(self) -> bool:
        return len(self._entries) >= self.max_entries

    def lookup(self, key: K, now_s: float, touch: bool = False) -> Optional[Held[V]]:
        """The live entry for ``key``, or None; an expired one is dropped. ``touch``: it becomes the newest."""
        held = self._entries.get(key)
        if held is None:
            return None
        if held.expired(now_s, self.ttl_s):
            del self._entries[key]
            return None
        if touch:
            self._entries.move_to_end(key)
        return held

    def get(self, key: K, now_s: float, touch: bool = False) -> Optional[V]:
        """The live value for ``key``, or None (as ``lookup``)."""
        held = self.lookup(key, now_s, touch)
        return None if held is None else held.value

    def put(
        self, key: K, value: V, done_at_s: Optional[float] = None, lease_until_s: float = math.inf
    ) -> Held[V]:
        """Hold ``value`` under ``key`` as the newest entry (replacing any); ``done_at_s``
        None: pending until ``finish``. A new key into a full map drops the oldest first."""
        if key in self._entries:
            del self._entries[key]
        else:
            self._make_room()
        held = Held(value, done_at_s, lease_until_s)
        self._entries[key] = held
        return held

    def remove(self, key: K, held: Optional[Held[V]] = None) -> None:
        """Drop ``key``'s entry (only if it is still ``held``, when given)."""
        if key in self._entries and (held is None or self._entries[key] is held):
            del self._entries[key]

    def expire(self, now_s: float) -> None:
        """Drop every expired entry."""
        for key in [k for k, h in self._entries.items() if h.expired(now_s, self.ttl_s)]:
            del self._entries[key]

    def _make_room(self) -> None:
        """Drop the oldest entries until one more fits (``keep_pending``: finished ones first)."""
        while len(self._entries) >= self.max_entries:
            victim = next(iter(self._entries))
            if self._keep_pending:
                victim = next((k for k, h in self._entries.items() if h.done), victim)
            del self._entries[victim]
