"""The one bounded TTL map: entries kept ``ttl_s`` after they finish, bounded in count
overall, and in count and bytes per group (a tenant).

Used by every store that remembers answers for a while: the router's Idempotency-Key
store, the key table every router shares, the cache of answers to identical calls. Each
keys its entries by (tenant, ...) and names the tenant as the entry's group.

An entry is *pending* (its TTL has not started: an answer still being made) or
*finished* at a time, from which it lives ``ttl_s`` (the boundary included: it is gone
once its age exceeds ``ttl_s``). A pending entry lives until it finishes, is removed,
or its lease runs out (``lease_until_s``, the instant itself excluded).

Bounds, checked when a new key is put or an entry finishes:

* ``max_entries_per_group``: a group at its bound loses its own oldest finished entry
  (least recently used, with ``touch``), never another group's;
* ``max_bytes_per_group``: the sizes of a group's finished entries (given at ``finish``);
  past it the group's oldest finished entries go (the new one too, if it alone is over);
* ``max_entries``: the backstop over all groups, oldest finished entry first.

A pending entry is never evicted: a new key that finds no room because its group (or
the whole map) holds only pending entries is refused (``put`` answers None).

Expiry is amortised O(1) entries visited per operation, with no scan of the map: the
TTL is the same for every entry, so finished entries expire in the order they finished
(one ordered dict, swept from its head until the first live one); pending entries with a
lease sit in a heap by lease end (each pushed once, popped once; one that finished or
left meanwhile is skipped when popped, and the heap is rebuilt without them once they
outnumber the live ones, so it stays within twice the leased entries). ``visited``
counts the entries every sweep and eviction looked at.

A plain data structure: time comes in as an argument (the caller reads its injected
clock, monotonic: an entry finished at an earlier time than the last one expires no
sooner than that one); nothing here reads a clock, sleeps or locks. Not thread-safe:
each map is owned by one store on one thread or event loop.

Written by hand: ``collections.OrderedDict`` is each order, but no standard-library type
bounds entries by count, bytes per group and an age that starts when the caller says.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from ballast.policies.validation import check_int, check_positive

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

#: Stale lease records tolerated before the heap is rebuilt (beside twice the live ones).
_HEAP_SLACK = 16


@dataclass
class Held(Generic[V]):
    """One entry: its value, when its TTL started (None: pending), its lease while
    pending, and its size in bytes once finished."""

    value: V
    done_at_s: float | None = None
    lease_until_s: float = math.inf
    size_bytes: int = 0
    seq: int = field(default=0, repr=False)  # its lease record in the heap

    @property
    def done(self) -> bool:
        return self.done_at_s is not None

    def expired(self, now_s: float, ttl_s: float) -> bool:
        """Finished more than ``ttl_s`` ago, or pending past its lease."""
        if self.done_at_s is not None:
            return now_s - self.done_at_s > ttl_s
        return now_s >= self.lease_until_s


@dataclass
class _Group(Generic[K]):
    """One group's entries: how many, the bytes of its finished ones, and those finished
    ones in eviction order (oldest, or least recently used, first)."""

    count: int = 0
    bytes: int = 0
    finished: OrderedDict[K, None] = field(default_factory=OrderedDict)


def _no_group(key: Hashable) -> None:
    return None


class TTLMap(Generic[K, V]):
    """Entries bounded in count (overall and per group), bytes per group, and age
    (``ttl_s`` after they finish).

    Invariants: ``len(self) <= max_entries``; each group holds at most
    ``max_entries_per_group`` entries and ``max_bytes_per_group`` bytes of finished ones;
    no pending entry is evicted; no lookup returns an expired entry."""

    def __init__(
        self,
        ttl_s: float,
        max_entries: int,
        *,
        max_entries_per_group: int | None = None,
        max_bytes_per_group: int | None = None,
        group: Callable[[K], Hashable] = _no_group,
    ) -> None:
        check_positive("ttl_s", ttl_s)
        check_int("max_entries", max_entries, minimum=1)
        if max_entries_per_group is not None:
            check_int("max_entries_per_group", max_entries_per_group, minimum=1)
        if max_bytes_per_group is not None:
            check_int("max_bytes_per_group", max_bytes_per_group, minimum=1)
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.max_entries_per_group = max_entries_per_group
        self.max_bytes_per_group = max_bytes_per_group
        self._group_of = group
        self._entries: dict[K, Held[V]] = {}
        self._expiry: OrderedDict[K, None] = OrderedDict()  # finished, in finish order
        self._victims: OrderedDict[K, None] = OrderedDict()  # finished, in eviction order
        self._groups: dict[Hashable, _Group[K]] = {}
        self._leases: list[tuple[float, int, K]] = []  # (lease end, seq, key): a heap
        self._leased = 0  # pending entries with a finite lease (live records in the heap)
        self._seq = 0
        self.visited = 0  # entries looked at by sweeps and evictions, since creation

    def __len__(self) -> int:
        return len(self._entries)

    def group_len(self, group: Hashable) -> int:
        g = self._groups.get(group)
        return 0 if g is None else g.count

    def group_bytes(self, group: Hashable) -> int:
        g = self._groups.get(group)
        return 0 if g is None else g.bytes

    def lookup(self, key: K, now_s: float, touch: bool = False) -> Held[V] | None:
        """The live entry for ``key``, or None; an expired one is dropped. ``touch``: a
        finished entry becomes the last to be evicted (its age is unchanged)."""
        held = self._entries.get(key)
        if held is None:
            return None
        if held.expired(now_s, self.ttl_s):
            self._drop(key)
            return None
        if touch and held.done:
            self._victims.move_to_end(key)
            self._groups[self._group_of(key)].finished.move_to_end(key)
        return held

    def get(self, key: K, now_s: float, touch: bool = False) -> V | None:
        """The live value for ``key``, or None (as ``lookup``)."""
        held = self.lookup(key, now_s, touch)
        return None if held is None else held.value

    def put(
        self,
        key: K,
        value: V,
        now_s: float,
        *,
        done: bool = False,
        lease_until_s: float = math.inf,
        size_bytes: int = 0,
    ) -> Held[V] | None:
        """Hold ``value`` under ``key`` (replacing any), pending until ``finish`` or, with
        ``done``, finished now (``size_bytes``). Expired entries go first, then the bounds
        make room (finished entries only). None when there is no room: the key's group, or
        the whole map, holds only pending entries; or a finished value alone is over its
        group's bytes."""
        if key in self._entries:
            self._drop(key)
        self.expire(now_s)
        if not self._make_room(key):
            return None
        held: Held[V] = Held(value, lease_until_s=lease_until_s)
        self._entries[key] = held
        self._groups.setdefault(self._group_of(key), _Group()).count += 1
        if done:
            return held if self.finish(key, held, now_s, size_bytes) else None
        if lease_until_s < math.inf:
            self._seq += 1
            held.seq = self._seq
            self._leased += 1
            heapq.heappush(self._leases, (lease_until_s, self._seq, key))
            if len(self._leases) > 2 * self._leased + _HEAP_SLACK:
                self._rebuild_leases()
        return held

    def finish(self, key: K, held: Held[V], now_s: float, size_bytes: int = 0) -> bool:
        """Start ``held``'s TTL at ``now_s``, its finished value ``size_bytes`` big; True
        when it is kept (False: it is no longer ``key``'s entry, or it alone is over its
        group's bytes and was dropped)."""
        if self._entries.get(key) is not held or held.done:
            return False
        if held.lease_until_s < math.inf:
            self._leased -= 1
        held.done_at_s = now_s
        held.size_bytes = size_bytes
        group = self._groups[self._group_of(key)]
        group.bytes += size_bytes
        group.finished[key] = None
        self._expiry[key] = None
        self._victims[key] = None
        if self.max_bytes_per_group is not None:
            while group.bytes > self.max_bytes_per_group:
                self._evict(next(iter(group.finished)))
        return key in self._entries

    def remove(self, key: K, held: Held[V] | None = None) -> None:
        """Drop ``key``'s entry (only if it is still ``held``, when given)."""
        if key in self._entries and (held is None or self._entries[key] is held):
            self._drop(key)

    def expire(self, now_s: float) -> None:
        """Drop every expired entry: finished ones from the head of the finish order,
        pending ones from the head of the lease heap; each stops at the first live one."""
        while self._expiry:
            key = next(iter(self._expiry))
            self.visited += 1
            if not self._entries[key].expired(now_s, self.ttl_s):
                break
            self._drop(key)
        while self._leases and self._leases[0][0] <= now_s:
            _, seq, key = heapq.heappop(self._leases)
            self.visited += 1
            held = self._entries.get(key)
            if held is not None and held.seq == seq and not held.done:
                self._drop(key)

    def _make_room(self, key: K) -> bool:
        """Evict finished entries until ``key`` fits its group's count and the map's;
        False when only pending entries stand in the way."""
        group = self._groups.get(self._group_of(key))
        if group is not None and self.max_entries_per_group is not None:
            while group.count >= self.max_entries_per_group:
                if not group.finished:
                    return False
                self._evict(next(iter(group.finished)))
        while len(self._entries) >= self.max_entries:
            if not self._victims:
                return False
            self._evict(next(iter(self._victims)))
        return True

    def _evict(self, key: K) -> None:
        self.visited += 1
        self._drop(key)

    def _drop(self, key: K) -> None:
        held = self._entries.pop(key)
        name = self._group_of(key)
        group = self._groups[name]
        group.count -= 1
        if held.done:
            group.bytes -= held.size_bytes
            del group.finished[key]
            del self._expiry[key]
            del self._victims[key]
        elif held.lease_until_s < math.inf:
            self._leased -= 1  # its heap record is stale now
        if group.count == 0:
            del self._groups[name]

    def _rebuild_leases(self) -> None:
        """The heap without the records of entries that finished or left (amortised: it
        runs once the stale records outnumber the live ones)."""
        live = [
            (lease, seq, key)
            for lease, seq, key in self._leases
            if (h := self._entries.get(key)) is not None and h.seq == seq and not h.done
        ]
        self.visited += len(self._leases)
        heapq.heapify(live)
        self._leases = live
