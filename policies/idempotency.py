"""Idempotency keys shared by every router: who generates a key's answer, and the answer.

A router that sees an ``Idempotency-Key`` for the first time *claims* it here. The
first claim wins and holds a lease (the request's deadline, plus a margin); every
other claim for the key, from any router, gets either the answer (``done``) or
``running`` (wait for it, then claim again). The owner ``complete``s with the
answer, or ``release``s the key when its attempt failed, so a retry runs for real.
A lease that runs out (the owner's router died with the request) frees the key the
same way.

Entries are bounded: answers are kept ``ttl_s`` after they complete; past
``max_entries`` the oldest finished ones go first, then the oldest claims. A key
evicted is simply a new key: it runs again.

Pure: the caller passes the time (``now_s``, monotonic in one process).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

from policies.validation import check_int, check_positive

MINE, RUNNING, DONE = "mine", "running", "done"


@dataclass
class _Entry:
    owner: str
    lease_until_s: float
    result: Optional[dict[str, Any]] = None
    done_at_s: Optional[float] = None


@dataclass(frozen=True)
class Claim:
    state: str  # MINE, RUNNING or DONE
    owner: str  # who generates it (or generated it)
    result: Optional[dict[str, Any]] = None


class KeyTable:
    def __init__(self, ttl_s: float, max_entries: int) -> None:
        check_positive("ttl_s", ttl_s)
        check_int("max_entries", max_entries, minimum=1)
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: "OrderedDict[tuple[str, str], _Entry]" = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def _live(self, slot: tuple[str, str], now_s: float) -> Optional[_Entry]:
        e = self._entries.get(slot)
        if e is None:
            return None
        gone = (e.done_at_s is not None and now_s - e.done_at_s > self.ttl_s) or (
            e.done_at_s is None and now_s >= e.lease_until_s
        )
        if gone:
            del self._entries[slot]
            return None
        return e

    def claim(self, slot: tuple[str, str], owner: str, lease_s: float, now_s: float) -> Claim:
        """The first live claim wins; a repeat by the same owner is still its own."""
        check_positive("lease_s", lease_s)
        e = self._live(slot, now_s)
        if e is None:
            self._make_room(now_s)
            self._entries[slot] = _Entry(owner, now_s + lease_s)
            return Claim(MINE, owner)
        if e.done_at_s is not None:
            return Claim(DONE, e.owner, e.result)
        return Claim(MINE if e.owner == owner else RUNNING, e.owner)

    def peek(self, slot: tuple[str, str], now_s: float) -> Optional[Claim]:
        """The key's state without claiming it; None when free."""
        e = self._live(slot, now_s)
        if e is None:
            return None
        return Claim(DONE, e.owner, e.result) if e.done_at_s is not None else Claim(RUNNING, e.owner)

    def complete(self, slot: tuple[str, str], owner: str, result: dict[str, Any], now_s: float) -> bool:
        """Keep the owner's answer; False when the claim was no longer its own (lease lost)."""
        e = self._live(slot, now_s)
        if e is None or e.owner != owner or e.done_at_s is not None:
            return False
        e.result, e.done_at_s = result, now_s
        return True

    def release(self, slot: tuple[str, str], owner: str, now_s: float) -> bool:
        """The owner's attempt failed: the key is free for the next claim."""
        e = self._live(slot, now_s)
        if e is None or e.owner != owner or e.done_at_s is not None:
            return False
        del self._entries[slot]
        return True

    def _make_room(self, now_s: float) -> None:
        if len(self._entries) < self.max_entries:
            return
        for slot in list(self._entries):
            self._live(slot, now_s)  # drops what expired
        while len(self._entries) >= self.max_entries:
            done = next((s for s, e in self._entries.items() if e.done_at_s is not None), None)
            del self._entries[done if done is not None else next(iter(self._entries))]
