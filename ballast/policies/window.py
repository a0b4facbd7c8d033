"""The two sliding windows every policy counts in: the last N samples, the last T seconds.

- ``CountWindow``: the last ``size`` samples, oldest first (resilience4j's
  ``FixedSizeSlidingWindowMetrics``, Netflix's ``limit/window`` sample windows). A
  sample is any value; with ``fields`` it is a tuple of that many numbers whose running
  sums ``totals()`` returns in O(1). Each sample is stamped with the time it was added,
  so a window bounded in count can also be bounded in age (``expire``).
- ``TimeWindow``: per-bucket sums over the last ``num_buckets`` buckets of ``bucket_s``
  seconds (resilience4j's ``SlidingTimeWindowMetrics``). Memory is ``num_buckets`` buckets
  whatever the rate of samples.

Both are plain data structures: time comes in as an argument (the caller reads its
injected clock), nothing here reads a clock, sleeps or locks. Not thread-safe: each is
owned by one policy on one thread. A limit or detector is fed samples from one of these
and owns no window of its own.

Written by hand: ``collections.deque(maxlen=...)`` is the ring, but no standard-library
type keeps running sums over it or ages buckets on a caller's clock.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

from ballast.policies.validation import check_int, check_positive

S = TypeVar("S")


class CountWindow(Generic[S]):
    """The last ``size`` samples, oldest first.

    Procedure: ``add`` appends a sample stamped ``at_s``; once ``size`` samples are held,
    the oldest leaves as the newest enters. ``expire(cutoff_s)`` drops, from the oldest,
    the samples stamped before ``cutoff_s`` (``inclusive``: at or before), for a window
    that is bounded in age as well as in count. With ``fields`` > 0 every sample is a
    tuple of ``fields`` numbers and ``totals()`` returns their sums over the samples held.

    Invariants: ``len(self) <= size``; ``totals()`` equals the field-wise sum of the
    samples held (exactly, for integer fields; the sums start again from 0 whenever the
    window empties). ``expire`` stops at the first sample it keeps, so stamps are meant
    to be added in ascending order (a clock that steps back only keeps a sample longer).
    """

    __slots__ = ("_items", "_size", "_fields", "_sums")

    def __init__(self, size: int, fields: int = 0) -> None:
        check_int("size", size, minimum=1)
        check_int("fields", fields, minimum=0)
        self._items: deque[tuple[float, S]] = deque(maxlen=size)
        self._size = size
        self._fields = fields
        self._sums: list[Any] = [0] * fields

    @property
    def size(self) -> int:
        """The most samples held."""
        return self._size

    def add(self, sample: S, at_s: float = 0.0) -> None:
        """Append ``sample`` stamped ``at_s``; the oldest leaves first when the window is full."""
        if self._fields:
            if len(self._items) == self._items.maxlen:
                self._forget(self._items[0][1])  # about to be pushed out by maxlen
            numbers: Any = sample  # with fields, a tuple of numbers (S is not bound to say so)
            for i, v in enumerate(numbers):
                self._sums[i] += v
        self._items.append((at_s, sample))

    def expire(self, cutoff_s: float, inclusive: bool = False) -> None:
        """Drop, oldest first, the samples stamped before ``cutoff_s`` (``inclusive``: at or before)."""
        items = self._items
        while items and (items[0][0] <= cutoff_s if inclusive else items[0][0] < cutoff_s):
            _, sample = items.popleft()
            if self._fields:
                self._forget(sample)
            if not items:
                self._sums = [0] * self._fields

    def totals(self, now_s: float | None = None) -> tuple[Any, ...]:
        """The sum of each field over the samples held; () without ``fields``.

        ``now_s`` is not read (a count window forgets by count, and by ``expire``): it is
        taken so that a policy holding either window reads it the same way."""
        return tuple(self._sums)

    def clear(self) -> None:
        self._items.clear()
        self._sums = [0] * self._fields

    def _forget(self, sample: Any) -> None:
        for i, v in enumerate(sample):
            self._sums[i] -= v

    def __len__(self) -> int:
        """Samples held."""
        return len(self._items)

    def __iter__(self) -> Iterator[S]:
        """The samples held, oldest first."""
        return (sample for _, sample in self._items)

    def __repr__(self) -> str:
        return f"CountWindow(size={self.size}, held={len(self._items)}, totals={self.totals()})"


class TimeWindow:
    """Per-field sums over the last ``num_buckets`` buckets of ``bucket_s`` seconds.

    Procedure: a sample at ``at_s`` is added to the bucket ``floor(at_s / bucket_s)``,
    opened when it is newer than the newest bucket; a sample whose time steps back (a
    clock that is not monotonic) is added to the newest bucket instead, which keeps the
    buckets in ascending order. A bucket leaves once it is ``num_buckets`` or more behind
    the bucket of the time the window is read or added to (``advance``): with one-second
    buckets and 60 of them, a sample at 40.9 counts at 99.99 and is gone at 100.0.

    Invariants: at most ``num_buckets`` buckets, in strictly ascending order, each holding
    something added; ``totals`` equals the field-wise sum of the buckets held (exactly,
    for integer fields; the sums start again from 0 whenever the window empties).
    """

    __slots__ = ("_bucket_s", "_num_buckets", "_fields", "_buckets", "_sums")

    def __init__(self, bucket_s: float, num_buckets: int, fields: int) -> None:
        check_positive("bucket_s", bucket_s)
        check_int("num_buckets", num_buckets, minimum=1)
        check_int("fields", fields, minimum=1)
        self._bucket_s = bucket_s
        self._num_buckets = num_buckets
        self._fields = fields
        # Each bucket: [key, sum of field 0, sum of field 1, ...]; keys strictly ascending.
        self._buckets: deque[list[Any]] = deque()
        self._sums: list[Any] = [0] * fields

    @property
    def num_buckets(self) -> int:
        """The most buckets held."""
        return self._num_buckets

    def _key(self, now_s: float) -> int:
        return math.floor(now_s / self._bucket_s)

    def advance(self, now_s: float) -> None:
        """Drop the buckets ``num_buckets`` or more behind the bucket of ``now_s``."""
        oldest_kept = self._key(now_s) - self._num_buckets + 1
        buckets = self._buckets
        while buckets and buckets[0][0] < oldest_kept:
            bucket = buckets.popleft()
            for i in range(self._fields):
                self._sums[i] -= bucket[i + 1]
            if not buckets:
                self._sums = [0] * self._fields

    def add(self, sample: tuple[Any, ...], at_s: float) -> None:
        """Add ``sample`` (one number per field) to the bucket of ``at_s`` (see the class docstring)."""
        self.advance(at_s)
        key = self._key(at_s)
        if self._buckets and self._buckets[-1][0] >= key:
            bucket = self._buckets[-1]
        else:
            bucket = [key] + [0] * self._fields
            self._buckets.append(bucket)
        for i, v in enumerate(sample):
            bucket[i + 1] += v
            self._sums[i] += v

    def totals(self, now_s: float) -> tuple[Any, ...]:
        """The sum of each field over the buckets held at ``now_s``."""
        self.advance(now_s)
        return tuple(self._sums)

    def buckets(self, now_s: float) -> list[tuple[Any, ...]]:
        """Each bucket held at ``now_s``, oldest first, as its per-field sums."""
        self.advance(now_s)
        return [tuple(b[1:]) for b in self._buckets]

    def newest_start_s(self) -> float | None:
        """Where the newest bucket starts (``key × bucket_s``); None when the window is empty."""
        return self._buckets[-1][0] * self._bucket_s if self._buckets else None

    def clear(self) -> None:
        self._buckets.clear()
        self._sums = [0] * self._fields

    def __len__(self) -> int:
        """Buckets held (as of the last add or read)."""
        return len(self._buckets)

    def __repr__(self) -> str:
        return (
            f"TimeWindow(bucket_s={self._bucket_s}, num_buckets={self._num_buckets}, "
            f"held={len(self._buckets)}, totals={tuple(self._sums)})"
        )
